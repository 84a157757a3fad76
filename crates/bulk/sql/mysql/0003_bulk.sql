-- Bulk v3, MySQL dialect: an index on claim_token. Without it every claim's read-back
-- (`SELECT ... WHERE claim_token = ?`, needed because TiDB ignores RETURNING) scans bulk_job.
-- PostgreSQL and SQLite read the claimed rows through RETURNING and need nothing.
CREATE INDEX IF NOT EXISTS bulk_job_claim ON bulk_job (claim_token);
