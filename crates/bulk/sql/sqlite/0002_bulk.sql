-- Bulk v2, SQLite: claims without progress (poison counts only those). Runs in the migration's
-- transaction with its version.
ALTER TABLE bulk_job ADD COLUMN stalled_claims INTEGER NOT NULL DEFAULT 0;
