-- Bulk v2, SQLite: claims without progress (poison counts only those), and the digest of a
-- job's rows (a key reused for other rows is refused; '' for jobs accepted before v2). Runs in the
-- migration's transaction with its version.
ALTER TABLE bulk_job ADD COLUMN stalled_claims INTEGER NOT NULL DEFAULT 0;
ALTER TABLE bulk_job ADD COLUMN content_digest TEXT NOT NULL DEFAULT '';
