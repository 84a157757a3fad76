-- Ownership v2, MySQL dialect: byte-exact utf8mb4 keys. Idempotent.
ALTER TABLE nexuscrm_schema CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE runtime_work_ownership CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE runtime_work_fence CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
