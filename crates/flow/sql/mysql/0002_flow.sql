-- Flow v2, MySQL dialect: byte-exact utf8mb4 for every key column (schedule names that differ
-- only in case or trailing spaces are distinct). Idempotent.
ALTER TABLE flow_schedule CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
ALTER TABLE flow_run CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
