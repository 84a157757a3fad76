-- Paused Flow family, MySQL dialect (MariaDB here, TiDB in production). Times are epoch
-- milliseconds from the store's clock.
-- name: pause_insert
INSERT INTO paused_step (run_ref, step, token_hash, state, payload, timeout_at, created_at, updated_at)
VALUES (?, ?, ?, 'paused', ?, ?, ?, ?)
-- name: pause_by_run_step
SELECT id FROM paused_step WHERE run_ref = ? AND step = ?
-- name: pause_by_token
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE token_hash = ? FOR UPDATE
-- name: pause_by_id
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE id = ?
-- name: pause_by_id_for_update
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE id = ? FOR UPDATE
-- name: pause_resume
UPDATE paused_step SET state = 'resumable', resume_payload = ?, resume_digest = ?, resumed_at = ?, updated_at = ?
WHERE id = ? AND state = 'paused'
-- name: pause_cancel
UPDATE paused_step SET state = 'cancelled', updated_at = ? WHERE id = ? AND state = 'paused'
-- name: pause_list
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step ORDER BY id DESC LIMIT ?
-- name: pause_list_state
SELECT id, run_ref, step, state, payload, resume_payload, timeout_at, resumed_at, attempts, created_at, updated_at, resume_digest FROM paused_step WHERE state = ? ORDER BY id DESC LIMIT ?
-- name: pause_counts
SELECT state, COUNT(*) FROM paused_step GROUP BY state
