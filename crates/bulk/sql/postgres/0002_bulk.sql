-- Bulk v2, PostgreSQL: claims without progress (poison counts only those).
ALTER TABLE bulk_job ADD COLUMN IF NOT EXISTS stalled_claims BIGINT NOT NULL DEFAULT 0;
