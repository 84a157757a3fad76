-- Bulk family, PostgreSQL.
-- Times are epoch milliseconds from the worker's clock.

-- name: job_by_key
SELECT id, content_digest FROM bulk_job WHERE idempotency_key = $1
-- name: job_insert
INSERT INTO bulk_job (idempotency_key, state, max_attempts, run_at, total_rows, segment_size, created_at, updated_at, content_digest)
VALUES ($1, 'pending', $2, $3, $4, $5, $6, $7, $8)
-- name: input_insert_prefix
INSERT INTO bulk_input (job_id, ordinal, record_key, fields) VALUES

-- Claim: one statement, bounded by bulk_job_due / bulk_job_lease.
-- name: claim
UPDATE bulk_job
SET state = 'running', claim_token = $1, lease_expires_at = $2, owner_generation = $3,
    attempts = attempts + 1, stalled_claims = stalled_claims + 1, updated_at = $4
WHERE id IN (
    SELECT id FROM bulk_job
    WHERE (state = 'pending' AND run_at <= $5) OR (state = 'running' AND lease_expires_at <= $6)
    ORDER BY id LIMIT $7
    FOR UPDATE SKIP LOCKED)
RETURNING id, attempts, max_attempts, cursor_ordinal, total_rows, segment_size, stalled_claims
-- name: claimed
SELECT id, attempts, max_attempts, cursor_ordinal, total_rows, segment_size, stalled_claims FROM bulk_job WHERE claim_token = $1

-- next_work_at: two indexed MIN reads.
-- name: next_run_at
SELECT MIN(run_at) FROM bulk_job WHERE state = 'pending'
-- name: next_lease_expiry
SELECT MIN(lease_expires_at) FROM bulk_job WHERE state = 'running'

-- Reconcile after an ownership transfer: jobs leased by older generations are released at once.
-- name: release_older_generations
UPDATE bulk_job SET state = 'pending', claim_token = NULL, lease_expires_at = NULL, updated_at = $1
WHERE state = 'running' AND owner_generation < $2

-- Attempt statements: every one is a compare-and-set on the claim token.
-- name: heartbeat
UPDATE bulk_job SET lease_expires_at = $1, updated_at = $2 WHERE id = $3 AND claim_token = $4 AND state = 'running' AND lease_expires_at > $2
-- name: job_for_segment
SELECT cursor_ordinal, total_rows, segment_size, applied_rows, rejected_rows FROM bulk_job
WHERE id = $1 AND claim_token = $2 AND state = 'running' AND lease_expires_at > $3 FOR UPDATE
-- name: segment_rows
SELECT ordinal, record_key, fields FROM bulk_input WHERE job_id = $1 AND ordinal >= $2 ORDER BY ordinal LIMIT $3
-- A segment's rows in multi-row statements (keys distinct within one statement).
-- name: record_upsert_prefix
INSERT INTO crm_record (record_key, revision, data, updated_at) VALUES
-- name: record_upsert_suffix
ON CONFLICT (record_key) DO UPDATE SET revision = crm_record.revision + 1, data = excluded.data, updated_at = excluded.updated_at
RETURNING record_key, revision
-- name: change_insert_prefix
INSERT INTO crm_record_change (job_id, ordinal, record_key, revision, applied_at) VALUES
-- name: row_error_insert
INSERT INTO bulk_row_error (job_id, ordinal, message) VALUES ($1, $2, $3)
-- name: segment_commit
UPDATE bulk_job SET cursor_ordinal = $1, applied_rows = $2, rejected_rows = $3, lease_expires_at = $4,
    state = $5, claim_token = $6, stalled_claims = 0, updated_at = $7
WHERE id = $8 AND claim_token = $9 AND state = 'running'
-- name: release
UPDATE bulk_job SET state = $1, claim_token = NULL, lease_expires_at = NULL, run_at = $2, attempts = attempts - $3,
    stalled_claims = GREATEST(stalled_claims - $4, 0), last_error = $5, updated_at = $6
WHERE id = $7 AND claim_token = $8 AND state = 'running'
-- An operator's retry of a poisoned job: pending at once, with a fresh count of claims without
-- progress (its cursor, applied rows and attempts stay).
-- name: retry
UPDATE bulk_job SET state = 'pending', run_at = $1, stalled_claims = 0, last_error = NULL, updated_at = $1
WHERE id = $2 AND state = 'poisoned'

-- Observations and the generation probe.
-- name: count_by_state
SELECT 'pending', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'pending' LIMIT $1) t0
UNION ALL SELECT 'running', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'running' LIMIT $2) t1
UNION ALL SELECT 'succeeded', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'succeeded' LIMIT $3) t2
UNION ALL SELECT 'poisoned', COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'poisoned' LIMIT $4) t3
-- name: oldest_eligible
SELECT MIN(run_at) FROM bulk_job WHERE state = 'pending' AND run_at <= $1
-- name: generation
SELECT MAX(id), (SELECT MAX(generation) FROM runtime_work_fence WHERE family = 'bulk'), (SELECT COALESCE(SUM(seq), 0)::BIGINT FROM runtime_work_signal WHERE family = 'bulk') FROM bulk_job
-- name: job_status
SELECT id, idempotency_key, state, attempts, max_attempts, cursor_ordinal, total_rows, applied_rows, rejected_rows, COALESCE(last_error, ''), run_at, stalled_claims, created_at
FROM bulk_job WHERE id = $1
-- name: job_list
SELECT id, idempotency_key, state, attempts, max_attempts, cursor_ordinal, total_rows, applied_rows, rejected_rows, COALESCE(last_error, ''), run_at, stalled_claims, created_at
FROM bulk_job ORDER BY id DESC LIMIT $1
-- name: eligible_count
SELECT COUNT(*) FROM (SELECT 1 FROM bulk_job WHERE state = 'pending' AND run_at <= $1 LIMIT $2) t
-- name: row_errors
SELECT ordinal, message FROM bulk_row_error WHERE job_id = $1 ORDER BY ordinal LIMIT $2
