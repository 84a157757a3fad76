-- Scheduled Flow family, MySQL dialect (MariaDB here, TiDB in production): no SKIP LOCKED or
-- RETURNING (TiDB ignores both): the claim is a conditional UPDATE ... LIMIT, then a read of the
-- rows carrying this claim's token.
-- Times are epoch milliseconds from the worker's clock.

-- Producer statements, each inside one transaction.
-- name: schedule_by_name
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule WHERE name = ?
-- name: schedule_by_id
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule WHERE id = ?
-- name: schedule_for_update
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule WHERE id = ? FOR UPDATE
-- name: schedule_list
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule ORDER BY id LIMIT ?
-- name: schedule_insert
INSERT INTO flow_schedule (name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, defined_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?)
-- An update recomputes the cursor and bumps the version: an in-flight reservation made under the
-- old version no longer matches and is rejected.
-- name: schedule_update
UPDATE flow_schedule SET spec_kind = ?, cron_expr = ?, zone = ?, interval_ms = ?, anchor_at = ?, policy = ?,
    catch_up_max = ?, next_occurrence_at = ?, state = ?, version = version + 1, claim_token = NULL,
    lease_expires_at = NULL, defined_at = ?, updated_at = ?
WHERE id = ?
-- name: schedule_set_state
UPDATE flow_schedule SET state = ?, next_occurrence_at = ?, version = version + 1, claim_token = NULL,
    lease_expires_at = NULL, defined_at = ?, updated_at = ?
WHERE id = ?
-- name: schedule_delete
DELETE FROM flow_schedule WHERE id = ?

-- Claim: one statement, bounded by flow_schedule_due / flow_schedule_lease.
-- name: claim
UPDATE flow_schedule
SET state = 'leased', claim_token = ?, lease_expires_at = ?, owner_generation = ?, updated_at = ?
WHERE (state = 'active' AND next_occurrence_at <= ?) OR (state = 'leased' AND lease_expires_at <= ?)
ORDER BY next_occurrence_at LIMIT ?
-- name: claimed
SELECT id, version FROM flow_schedule WHERE claim_token = ?

-- next_work_at: two indexed MIN reads.
-- name: next_occurrence
SELECT MIN(next_occurrence_at) FROM flow_schedule WHERE state = 'active'
-- name: next_lease_expiry
SELECT MIN(lease_expires_at) FROM flow_schedule WHERE state = 'leased'

-- Reconcile after an ownership transfer: schedules leased by older generations are released.
-- name: release_older_generations
UPDATE flow_schedule SET state = 'active', claim_token = NULL, lease_expires_at = NULL, updated_at = ?
WHERE state = 'leased' AND owner_generation < ?

-- Reservation statements: each is a compare-and-set on the claim token and the version.
-- name: heartbeat
UPDATE flow_schedule SET lease_expires_at = ?, updated_at = ?
WHERE id = ? AND claim_token = ? AND version = ? AND state = 'leased' AND lease_expires_at > ?
-- name: reserve_read
SELECT flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, next_occurrence_at
FROM flow_schedule
WHERE id = ? AND claim_token = ? AND version = ? AND state = 'leased' AND lease_expires_at > ? FOR UPDATE
-- name: run_insert
INSERT INTO flow_run (schedule_id, flow, occurrence_at, reserved_at, schedule_version, owner_generation, state)
VALUES (?, ?, ?, ?, ?, ?, 'pending')
-- name: reserve_commit
UPDATE flow_schedule SET next_occurrence_at = ?, last_occurrence_at = COALESCE(?, last_occurrence_at),
    runs = runs + ?, state = ?, claim_token = ?, lease_expires_at = ?, updated_at = ?
WHERE id = ? AND claim_token = ? AND version = ? AND state = 'leased'
-- name: release
UPDATE flow_schedule SET state = 'active', claim_token = NULL, lease_expires_at = NULL, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'leased'
-- A failed reservation (rolled back) gives the claim up until the lease time it sets.
-- name: defer
UPDATE flow_schedule SET claim_token = NULL, lease_expires_at = ?, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'leased'

-- Observations and the generation probe.
-- name: count_by_state
SELECT 'active', COUNT(*) FROM (SELECT 1 FROM flow_schedule WHERE state = 'active' LIMIT ?) t0
UNION ALL SELECT 'leased', COUNT(*) FROM (SELECT 1 FROM flow_schedule WHERE state = 'leased' LIMIT ?) t1
UNION ALL SELECT 'paused', COUNT(*) FROM (SELECT 1 FROM flow_schedule WHERE state = 'paused' LIMIT ?) t2
-- name: oldest_due
SELECT MIN(next_occurrence_at) FROM flow_schedule WHERE state = 'active' AND next_occurrence_at <= ?
-- name: run_count
SELECT COUNT(*) FROM (SELECT 1 FROM flow_run LIMIT ?) t
-- name: generation
SELECT MAX(id), MAX(defined_at), (SELECT MAX(generation) FROM runtime_work_fence WHERE family = 'flow'), (SELECT CAST(COALESCE(SUM(seq), 0) AS SIGNED) FROM runtime_work_signal WHERE family = 'flow') FROM flow_schedule
-- name: runs_of
SELECT id, schedule_id, flow, occurrence_at, reserved_at, schedule_version FROM flow_run
WHERE schedule_id = ? ORDER BY occurrence_at DESC LIMIT ?
-- name: runs_recent
SELECT id, schedule_id, flow, occurrence_at, reserved_at, schedule_version FROM flow_run ORDER BY id DESC LIMIT ?
