-- Bulk v2, MySQL dialect: claims without progress (poison counts only those), the digest of a
-- job's rows (a key reused for other rows is refused; '' for jobs accepted before v2), and every key
-- column byte-exact utf8mb4 (keys differing only in case, trailing spaces or emoji are distinct
-- records; a latin1 server default cannot refuse a Unicode key). Idempotent: DDL commits
-- implicitly here, so an interrupted migration is re-run.
ALTER TABLE bulk_job ADD COLUMN IF NOT EXISTS stalled_claims BIGINT NOT NULL DEFAULT 0;
ALTER TABLE bulk_job ADD COLUMN IF NOT EXISTS content_digest VARCHAR(64) NOT NULL DEFAULT '';
ALTER TABLE bulk_job CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE bulk_input CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE bulk_row_error CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE crm_record CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE crm_record_change CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
