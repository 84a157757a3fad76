-- Scheduled Flow family, PostgreSQL.
-- Times are epoch milliseconds from the worker's clock.

-- Producer statements, each inside one transaction.
-- name: schedule_by_name
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule WHERE name = $1
-- name: schedule_by_id
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule WHERE id = $1
-- name: schedule_for_update
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule WHERE id = $1 FOR UPDATE
-- name: schedule_list
SELECT id, name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, last_occurrence_at, runs
FROM flow_schedule ORDER BY id LIMIT $1
-- name: schedule_insert
INSERT INTO flow_schedule (name, flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, state, version, next_occurrence_at, defined_at, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 1, $11, $12, $13, $14)
-- An update recomputes the cursor and bumps the version: an in-flight reservation made under the
-- old version no longer matches and is rejected.
-- name: schedule_update
UPDATE flow_schedule SET spec_kind = $1, cron_expr = $2, zone = $3, interval_ms = $4, anchor_at = $5, policy = $6,
    catch_up_max = $7, next_occurrence_at = $8, state = $9, version = version + 1, claim_token = NULL,
    lease_expires_at = NULL, defined_at = $10, updated_at = $11
WHERE id = $12
-- name: schedule_set_state
UPDATE flow_schedule SET state = $1, next_occurrence_at = $2, version = version + 1, claim_token = NULL,
    lease_expires_at = NULL, defined_at = $3, updated_at = $4
WHERE id = $5
-- name: schedule_delete
DELETE FROM flow_schedule WHERE id = $1

-- Claim: one statement, bounded by flow_schedule_due / flow_schedule_lease.
-- name: claim
UPDATE flow_schedule
SET state = 'leased', claim_token = $1, lease_expires_at = $2, owner_generation = $3, updated_at = $4
WHERE id IN (
    SELECT id FROM flow_schedule
    WHERE (state = 'active' AND next_occurrence_at <= $5) OR (state = 'leased' AND lease_expires_at <= $6)
    ORDER BY next_occurrence_at LIMIT $7
    FOR UPDATE SKIP LOCKED)
RETURNING id, version
-- The same claim with its fence read folded in (PostgreSQL), run inside the claim transaction:
-- one statement instead of two. The fence stripe's FOR SHARE lock (persistence's fence_read) is
-- held until the transaction commits, so a takeover (which writes every stripe) waits for it,
-- and a claim waiting on a takeover re-reads the stripe and sees the newer generation. One row
-- per claimed schedule; one row with a NULL id when nothing was claimed (the fence's generation
-- says whether it was ours); none when the stripe is missing.
-- name: claim_fenced
WITH fence AS (
    SELECT generation FROM runtime_work_fence_stripe WHERE family = $8 AND stripe = $9 FOR SHARE
), claimed AS (
    UPDATE flow_schedule
    SET state = 'leased', claim_token = $1, lease_expires_at = $2, owner_generation = $3, updated_at = $4
    WHERE EXISTS (SELECT 1 FROM fence WHERE generation = $3) AND id IN (
        SELECT id FROM flow_schedule
        WHERE (state = 'active' AND next_occurrence_at <= $5) OR (state = 'leased' AND lease_expires_at <= $6)
        ORDER BY next_occurrence_at LIMIT $7
        FOR UPDATE SKIP LOCKED)
    RETURNING id, version
)
SELECT fence.generation, claimed.id, claimed.version FROM fence LEFT JOIN claimed ON TRUE
-- name: claimed
SELECT id, version FROM flow_schedule WHERE claim_token = $1

-- next_work_at: two indexed MIN reads.
-- name: next_occurrence
SELECT MIN(next_occurrence_at) FROM flow_schedule WHERE state = 'active'
-- name: next_lease_expiry
SELECT MIN(lease_expires_at) FROM flow_schedule WHERE state = 'leased'

-- Reconcile after an ownership transfer: schedules leased by older generations are released.
-- name: release_older_generations
UPDATE flow_schedule SET state = 'active', claim_token = NULL, lease_expires_at = NULL, updated_at = $1
WHERE state = 'leased' AND owner_generation < $2

-- Reservation statements: each is a compare-and-set on the claim token and the version.
-- name: heartbeat
UPDATE flow_schedule SET lease_expires_at = $1, updated_at = $2
WHERE id = $3 AND claim_token = $4 AND version = $5 AND state = 'leased' AND lease_expires_at > $6
-- name: reserve_read
SELECT flow, spec_kind, cron_expr, zone, interval_ms, anchor_at, policy, catch_up_max, next_occurrence_at
FROM flow_schedule
WHERE id = $1 AND claim_token = $2 AND version = $3 AND state = 'leased' AND lease_expires_at > $4 FOR UPDATE
-- The same read with the fence read folded in (PostgreSQL; see claim_fenced): no row when the
-- schedule is no longer ours or the generation is fenced out, either way a stale reservation.
-- name: reserve_read_fenced
WITH fence AS (
    SELECT generation FROM runtime_work_fence_stripe WHERE family = $5 AND stripe = $6 FOR SHARE
)
SELECT s.flow, s.spec_kind, s.cron_expr, s.zone, s.interval_ms, s.anchor_at, s.policy, s.catch_up_max, s.next_occurrence_at
FROM flow_schedule s
WHERE EXISTS (SELECT 1 FROM fence WHERE generation = $7)
  AND s.id = $1 AND s.claim_token = $2 AND s.version = $3 AND s.state = 'leased' AND s.lease_expires_at > $4
FOR UPDATE OF s
-- name: run_insert
INSERT INTO flow_run (schedule_id, flow, occurrence_at, reserved_at, schedule_version, owner_generation, state)
VALUES ($1, $2, $3, $4, $5, $6, 'pending')
-- name: reserve_commit
UPDATE flow_schedule SET next_occurrence_at = $1, last_occurrence_at = COALESCE($2, last_occurrence_at),
    runs = runs + $3, state = $4, claim_token = $5, lease_expires_at = $6, updated_at = $7
WHERE id = $8 AND claim_token = $9 AND version = $10 AND state = 'leased'
-- name: release
UPDATE flow_schedule SET state = 'active', claim_token = NULL, lease_expires_at = NULL, updated_at = $1
WHERE id = $2 AND claim_token = $3 AND state = 'leased'
-- A failed reservation (rolled back) gives the claim up until the lease time it sets.
-- name: defer
UPDATE flow_schedule SET claim_token = NULL, lease_expires_at = $1, updated_at = $2
WHERE id = $3 AND claim_token = $4 AND state = 'leased'

-- Observations and the generation probe.
-- name: count_by_state
SELECT 'active', COUNT(*) FROM (SELECT 1 FROM flow_schedule WHERE state = 'active' LIMIT $1) t0
UNION ALL SELECT 'leased', COUNT(*) FROM (SELECT 1 FROM flow_schedule WHERE state = 'leased' LIMIT $2) t1
UNION ALL SELECT 'paused', COUNT(*) FROM (SELECT 1 FROM flow_schedule WHERE state = 'paused' LIMIT $3) t2
-- name: oldest_due
SELECT MIN(next_occurrence_at) FROM flow_schedule WHERE state = 'active' AND next_occurrence_at <= $1
-- name: run_count
SELECT COUNT(*) FROM (SELECT 1 FROM flow_run LIMIT $1) t
-- name: generation
SELECT MAX(id), MAX(defined_at), (SELECT MAX(generation) FROM runtime_work_fence WHERE family = 'flow'), (SELECT COALESCE(SUM(seq), 0)::BIGINT FROM runtime_work_signal WHERE family = 'flow') FROM flow_schedule
-- name: runs_of
SELECT id, schedule_id, flow, occurrence_at, reserved_at, schedule_version FROM flow_run
WHERE schedule_id = $1 ORDER BY occurrence_at DESC LIMIT $2
-- name: runs_recent
SELECT id, schedule_id, flow, occurrence_at, reserved_at, schedule_version FROM flow_run ORDER BY id DESC LIMIT $1
