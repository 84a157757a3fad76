-- Bulk family, SQLite. Every write runs inside BEGIN IMMEDIATE (one writer at a time).
-- Times are epoch milliseconds from the worker's clock.

-- name: job_by_key
SELECT id, content_digest FROM bulk_job WHERE idempotency_key = ?
-- name: job_insert
INSERT INTO bulk_job (idempotency_key, state, max_attempts, run_at, total_rows, segment_size, created_at, updated_at, content_digest)
VALUES (?, 'pending', ?, ?, ?, ?, ?, ?, ?)
-- name: input_insert_prefix
INSERT INTO bulk_input (job_id, ordinal, record_key, fields) VALUES

-- Claim: one statement, bounded by bulk_job_due / bulk_job_lease.
-- name: claim
UPDATE bulk_job
SET state = 'running', claim_token = ?, lease_expires_at = ?, owner_generation = ?,
    attempts = attempts + 1, stalled_claims = stalled_claims + 1, updated_at = ?
WHERE id IN (
    SELECT id FROM bulk_job WHERE state = 'pending' AND run_at <= ?
    UNION ALL
    SELECT id FROM bulk_job WHERE state = 'running' AND lease_expires_at <= ?
    ORDER BY id LIMIT ?)
RETURNING id, attempts, max_attempts, cursor_ordinal, total_rows, segment_size, stalled_claims
-- name: claimed
SELECT id, attempts, max_attempts, cursor_ordinal, total_rows, segment_size, stalled_claims FROM bulk_job WHERE claim_token = ?

-- next_work_at: two indexed MIN reads.
-- name: next_run_at
SELECT MIN(run_at) FROM bulk_job WHERE state = 'pending'
-- name: next_lease_expiry
SELECT MIN(lease_expires_at) FROM bulk_job WHERE state = 'running'

-- Reconcile after an ownership transfer: jobs leased by older generations are released at once.
-- name: release_older_generations
UPDATE bulk_job SET state = 'pending', claim_token = NULL, lease_expires_at = NULL, updated_at = ?
WHERE state = 'running' AND owner_generation < ?

-- Attempt statements: every one is a compare-and-set on the claim token.
-- name: heartbeat
UPDATE bulk_job SET lease_expires_at = ?, updated_at = ? WHERE id = ? AND claim_token = ? AND state = 'running' AND lease_expires_at > ?
-- name: job_for_segment
SELECT cursor_ordinal, total_rows, segment_size, applied_rows, rejected_rows FROM bulk_job
WHERE id = ? AND claim_token = ? AND state = 'running' AND lease_expires_at > ?
-- name: segment_rows
SELECT ordinal, record_key, fields FROM bulk_input WHERE job_id = ? AND ordinal >= ? ORDER BY ordinal LIMIT ?
-- A segment's rows in multi-row statements (keys distinct within one statement).
-- name: record_upsert_prefix
INSERT INTO crm_record (record_key, revision, data, updated_at) VALUES
-- name: record_upsert_suffix
ON CONFLICT (record_key) DO UPDATE SET revision = crm_record.revision + 1, data = excluded.data, updated_at = excluded.updated_at
RETURNING record_key, revision
-- name: change_insert_prefix
INSERT INTO crm_record_change (job_id, ordinal, record_key, revision, applied_at) VALUES
-- name: row_error_insert
INSERT INTO bulk_row_error (job_id, ordinal, message) VALUES (?, ?, ?)
-- name: segment_commit
UPDATE bulk_job SET cursor_ordinal = ?, applied_rows = ?, rejected_rows = ?, lease_expires_at = ?,
    state = ?, claim_token = ?, stalled_claims = 0, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'running'
-- name: release
UPDATE bulk_job SET state = ?, claim_token = NULL, lease_expires_at = NULL, run_at = ?, attempts = attempts - ?,
    stalled_claims = MAX(stalled_claims - ?, 0), last_error = ?, updated_at = ?
WHERE id = ? AND claim_token = ? AND state = 'running'
-- An operator's retry of a poisoned job: pending at once, with a fresh count of claims without
-- progress (its cursor, applied rows and attempts stay).
-- name: retry
UPDATE bulk_job SET state = 'pending', run_at = ?, stalled_claims = 0, last_error = NULL, updated_at = ?
WHERE id = ? AND state = 'poisoned'

-- Observations and the generation probe.
-- name: count_by_state
SELECT 'pending', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'pending' LIMIT ?) t0
UNION ALL SELECT 'running', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'running' LIMIT ?) t1
UNION ALL SELECT 'succeeded', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'succeeded' LIMIT ?) t2
UNION ALL SELECT 'poisoned', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'poisoned' LIMIT ?) t3
-- name: oldest_eligible
SELECT MIN(run_at) FROM bulk_job WHERE state = 'pending' AND run_at <= ?
-- name: generation
SELECT MAX(id), (SELECT MAX(generation) FROM runtime_work_fence WHERE family = 'bulk'), (SELECT COALESCE(SUM(seq), 0) FROM runtime_work_signal WHERE family = 'bulk') FROM bulk_job
-- name: job_status
SELECT id, idempotency_key, state, attempts, max_attempts, cursor_ordinal, total_rows, applied_rows, rejected_rows, COALESCE(last_error, ''), run_at, stalled_claims, created_at
FROM bulk_job WHERE id = ?
-- name: job_list
SELECT id, idempotency_key, state, attempts, max_attempts, cursor_ordinal, total_rows, applied_rows, rejected_rows, COALESCE(last_error, ''), run_at, stalled_claims, created_at
FROM bulk_job ORDER BY id DESC LIMIT ?
-- name: eligible_count
SELECT COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'pending' AND run_at <= ? LIMIT ?) t
-- name: row_errors
SELECT ordinal, message FROM bulk_row_error WHERE job_id = ? ORDER BY ordinal LIMIT ?
