-- Bulk v2, PostgreSQL: claims without progress (poison counts only those), and the digest of
-- a job's rows (a key reused for other rows is refused; '' for jobs accepted before v2).
ALTER TABLE bulk_job ADD COLUMN IF NOT EXISTS stalled_claims BIGINT NOT NULL DEFAULT 0;
ALTER TABLE bulk_job ADD COLUMN IF NOT EXISTS content_digest VARCHAR(64) NOT NULL DEFAULT '';
