-- Paused Flow family, PostgreSQL. Times are epoch milliseconds from the store's clock.
-- name: pause_insert
INSERT INTO paused_step (run_ref, step, token_hash, state, payload, timeout_at, created_at, updated_at)
VALUES ($1, $2, $3, 'paused', $4, $5, $6, $7)
-- name: pause_by_run_step
SELECT id FROM paused_step WHERE run_ref = $1 AND step = $2
-- name: pause_by_token
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE token_hash = $1 FOR UPDATE
-- name: pause_by_id
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE id = $1
-- name: pause_by_id_for_update
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE id = $1 FOR UPDATE
-- name: pause_resume
UPDATE paused_step SET state = 'resumable', resume_payload = $1, resume_digest = $2, resumed_at = $3, updated_at = $4
WHERE id = $5 AND state = 'paused'
-- name: pause_cancel
UPDATE paused_step SET state = 'cancelled', updated_at = $1 WHERE id = $2 AND state = 'paused'
-- name: pause_list
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step ORDER BY id DESC LIMIT $1
-- name: pause_list_state
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE state = $1 ORDER BY id DESC LIMIT $2
-- name: pause_counts
SELECT state, COUNT(*) FROM paused_step GROUP BY state
