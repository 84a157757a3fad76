-- Paused Flow family, PostgreSQL. Times are epoch milliseconds from the store's clock.
-- name: pause_insert
INSERT INTO paused_step (run_ref, step, token_hash, state, payload, timeout_at, created_at, updated_at, effect_key)
VALUES ($1, $2, $3, 'paused', $4, $5, $6, $7, $8)
-- name: pause_by_run_step
SELECT id FROM paused_step WHERE run_ref = $1 AND step = $2
-- name: pause_by_token
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step WHERE token_hash = $1 FOR UPDATE
-- name: pause_by_id
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step WHERE id = $1
-- name: pause_resume
UPDATE paused_step SET state = 'resumable', resume_payload = $1, resume_digest = $2, resumed_at = $3, available_at = $4, updated_at = $5
WHERE id = $6 AND state = 'paused'
-- name: pause_cancel
UPDATE paused_step SET state = 'cancelled', updated_at = $1 WHERE id = $2 AND state = 'paused'
-- name: pause_list
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step ORDER BY id DESC LIMIT $1
-- name: pause_list_state
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest, outcome, effect_key, intent_at FROM paused_step WHERE state = $1 ORDER BY id DESC LIMIT $2
-- name: pause_counts
SELECT state, COUNT(*) FROM paused_step GROUP BY state
-- name: time_out
UPDATE paused_step SET state = 'timed_out', available_at = timeout_at, updated_at = $1 WHERE state = 'paused' AND timeout_at <= $2
-- name: quarantine_expired
UPDATE paused_step SET state = $1, claim_token = NULL, lease_expires_at = NULL, outcome = $2, updated_at = $3
WHERE state = 'leased' AND lease_expires_at <= $4 AND intent_at IS NOT NULL
-- name: release_expired
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, updated_at = $1
WHERE state = 'leased' AND lease_expires_at <= $2 AND intent_at IS NULL
-- name: quarantine_older
UPDATE paused_step SET state = $1, claim_token = NULL, lease_expires_at = NULL, outcome = $2, updated_at = $3
WHERE state = 'leased' AND owner_generation < $4 AND intent_at IS NOT NULL
-- name: release_older
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, updated_at = $1
WHERE state = 'leased' AND owner_generation < $2 AND intent_at IS NULL
-- name: eligible
SELECT id FROM paused_step WHERE state IN ('resumable', 'timed_out', 'observing') AND available_at <= $1 ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED
-- name: lease
UPDATE paused_step SET state = 'leased', claim_token = $1, lease_expires_at = $2, owner_generation = $3, attempts = attempts + 1, updated_at = $4
WHERE id = $5 AND state IN ('resumable', 'timed_out', 'observing')
-- name: claimed
SELECT id, run_ref, step, payload, resume_payload, effect_key, attempts, intent_at FROM paused_step WHERE claim_token = $1 AND state = 'leased' ORDER BY id
-- name: intent
UPDATE paused_step SET intent_at = $1, intent_attempt = attempts, updated_at = $2
WHERE id = $3 AND claim_token = $4 AND state = 'leased' AND lease_expires_at > $5
-- name: heartbeat
UPDATE paused_step SET lease_expires_at = $1, updated_at = $2 WHERE id = $3 AND claim_token = $4 AND state = 'leased' AND lease_expires_at > $5
-- name: finish
UPDATE paused_step SET state = $1, outcome = $2, finished_at = $3, claim_token = NULL, lease_expires_at = NULL, updated_at = $4
WHERE id = $5 AND claim_token = $6 AND state = 'leased' AND lease_expires_at > $7
-- name: release
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, intent_at = NULL, available_at = $1, outcome = $2, updated_at = $3
WHERE id = $4 AND claim_token = $5 AND state = 'leased' AND lease_expires_at > $6
-- A release before anything was sent (a drain) gives the claim back: its attempt is not charged.
-- name: release_unclaimed
UPDATE paused_step SET state = CASE WHEN resumed_at IS NULL THEN 'timed_out' ELSE 'resumable' END, claim_token = NULL,
    lease_expires_at = NULL, attempts = attempts - 1, intent_at = NULL, available_at = $1, outcome = $2, updated_at = $3
WHERE id = $4 AND claim_token = $5 AND state = 'leased' AND lease_expires_at > $6
-- name: resolve
UPDATE paused_step SET state = $1, intent_at = NULL, available_at = $2, outcome = $3, finished_at = $4, updated_at = $5, resolved_at = $6 WHERE id = $7 AND state = 'uncertain'
-- name: next_timeout
SELECT MIN(timeout_at) FROM paused_step WHERE state = 'paused'
-- name: next_lease_expiry
SELECT MIN(lease_expires_at) FROM paused_step WHERE state = 'leased'
-- name: next_available
SELECT MIN(available_at) FROM paused_step WHERE state IN ('resumable', 'timed_out', 'observing')
-- name: generation
SELECT MAX(id), MAX(resumed_at), MAX(resolved_at), (SELECT COALESCE(SUM(seq), 0)::BIGINT FROM runtime_work_signal WHERE family = 'paused') FROM paused_step
-- name: oldest_uncertain
SELECT MIN(updated_at) FROM paused_step WHERE state = 'uncertain'
-- name: pause_counts_capped
SELECT 'paused', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'paused' LIMIT $1) t0
UNION ALL SELECT 'resumable', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'resumable' LIMIT $2) t1
UNION ALL SELECT 'timed_out', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'timed_out' LIMIT $3) t2
UNION ALL SELECT 'leased', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'leased' LIMIT $4) t3
UNION ALL SELECT 'observing', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'observing' LIMIT $5) t4
UNION ALL SELECT 'completed', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'completed' LIMIT $6) t5
UNION ALL SELECT 'uncertain', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'uncertain' LIMIT $7) t6
UNION ALL SELECT 'poisoned', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'poisoned' LIMIT $8) t7
UNION ALL SELECT 'cancelled', COUNT(*) FROM (SELECT 1 FROM paused_step WHERE state = 'cancelled' LIMIT $9) t8
