-- Paused Flow family, MySQL dialect (MariaDB here, TiDB in production): no SKIP LOCKED, the
-- fence row serializes claims. Times are epoch milliseconds from the store's clock.
-- name: pause_insert
INSERT INTO paused_step (run_ref, step, token_hash, state, payload, timeout_at, created_at, updated_at, effect_key)
VALUES (?, ?, ?, 'paused', ?, ?, ?, ?, ?)
-- name: pause_by_run_step
SELECT id FROM paused_step WHERE run_ref = ? AND step = ?
-- name: pause_by_token
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step WHERE token_hash = ? FOR UPDATE
-- name: pause_by_id
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step WHERE id = ?
-- name: pause_resume
UPDATE paused_step SET state = 'resumable', resume_payload = ?, resume_digest = ?, resumed_at = ?, available_at = ?, updated_at = ?
WHERE id = ? AND state = 'paused'
-- name: pause_cancel
UPDATE paused_step SET state = 'cancelled', updated_at = ? WHERE id = ? AND state = 'paused'
-- name: pause_list
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step ORDER BY id DESC LIMIT ?
-- name: pause_list_state
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step WHERE state = ? ORDER BY id DESC LIMIT ?
-- name: pause_counts
SELECT state, COUNT(*) FROM paused_step GROUP BY state
-- name: time_out
UPDATE paused_step SET state = 'timed_out', available_at = timeout_at, updated_at = ? WHERE state = 'paused' AND timeout_at <= ?
-- name: quarantine_expired
UPDATE paused_step SET state = ?, claim_token = NULL, lease_expires_at = NULL, outcome = ?, updated_at = ?
WHERE state = 'leased' AND lease_expires_at <= ? AND intent_at IS NOT NULL
-- name: release_expired
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, updated_at = ?
WHERE state = 'leased' AND lease_expires_at <= ? AND intent_at IS NULL
-- name: quarantine_older
UPDATE paused_step SET state = ?, claim_token = NULL, lease_expires_at = NULL, outcome = ?, updated_at = ?
WHERE state = 'leased' AND owner_generation < ? AND intent_at IS NOT NULL
-- name: release_older
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, updated_at = ?
WHERE state = 'leased' AND owner_generation < ? AND intent_at IS NULL
-- name: eligible
SELECT id FROM paused_step WHERE state IN ('resumable', 'timed_out', 'observing') AND available_at <= ? ORDER BY available_at, id LIMIT ? FOR UPDATE
-- name: lease
UPDATE paused_step SET state = 'leased', claim_token = ?, lease_expires_at = ?, owner_generation = ?, attempts = attempts + 1, updated_at = ?
WHERE id = ? AND state IN ('resumable', 'timed_out', 'observing')
-- name: claimed
SELECT id, run_ref, step, payload, resume_payload, effect_key, attempts, intent_at FROM paused_step WHERE claim_token = ? AND state = 'leased' ORDER BY id
-- name: intent
UPDATE paused_step SET intent_at = ?, intent_attempt = attempts, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'leased' AND lease_expires_at > ?
-- name: heartbeat
UPDATE paused_step SET lease_expires_at = ?, updated_at = ? WHERE id = ? AND claim_token = ? AND state = 'leased' AND lease_expires_at > ?
-- name: finish
UPDATE paused_step SET state = ?, outcome = ?, finished_at = ?, claim_token = NULL, lease_expires_at = NULL, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'leased' AND lease_expires_at > ?
-- name: release
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, intent_at = NULL, available_at = ?, outcome = ?, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'leased' AND lease_expires_at > ?
-- A release before anything was sent (a drain) gives the claim back: its attempt is not charged.
-- name: release_unclaimed
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, attempts = attempts - 1, intent_at = NULL, available_at = ?, outcome = ?, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'leased' AND lease_expires_at > ?
-- name: resolve
UPDATE paused_step SET state = ?, intent_at = NULL, available_at = ?, outcome = ?, finished_at = ?, updated_at = ?, resolved_at = ? WHERE id = ? AND state = 'uncertain'
-- name: next_timeout
SELECT MIN(timeout_at) FROM paused_step WHERE state = 'paused'
-- name: next_lease_expiry
SELECT MIN(lease_expires_at) FROM paused_step WHERE state = 'leased'
-- name: next_available
SELECT MIN(available_at) FROM paused_step WHERE state IN ('resumable', 'timed_out', 'observing')
-- name: generation
SELECT MAX(id), MAX(resumed_at), MAX(resolved_at), (SELECT CAST(COALESCE(SUM(seq), 0) AS SIGNED) FROM runtime_work_signal WHERE family = 'paused') FROM paused_step
-- name: oldest_uncertain
SELECT MIN(updated_at) FROM paused_step WHERE state = 'uncertain'
-- name: pause_counts_capped
SELECT 'paused', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'paused' LIMIT ?) t0
UNION ALL SELECT 'resumable', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'resumable' LIMIT ?) t1
UNION ALL SELECT 'timed_out', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'timed_out' LIMIT ?) t2
UNION ALL SELECT 'leased', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'leased' LIMIT ?) t3
UNION ALL SELECT 'observing', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'observing' LIMIT ?) t4
UNION ALL SELECT 'completed', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'completed' LIMIT ?) t5
UNION ALL SELECT 'uncertain', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'uncertain' LIMIT ?) t6
UNION ALL SELECT 'poisoned', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'poisoned' LIMIT ?) t7
UNION ALL SELECT 'cancelled', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'cancelled' LIMIT ?) t8
