-- Runtime work ownership and fence, MySQL dialect (MariaDB, MySQL; TiDB noted).
-- name: schema_create
CREATE TABLE IF NOT EXISTS nexuscrm_schema (component VARCHAR(64) NOT NULL PRIMARY KEY, version BIGINT NOT NULL) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin
-- name: schema_read
SELECT version FROM nexuscrm_schema WHERE component = ?
-- name: schema_insert
INSERT INTO nexuscrm_schema (component, version) VALUES (?, ?)
-- name: schema_update
UPDATE nexuscrm_schema SET version = ? WHERE component = ?
-- name: ownership_read
SELECT generation FROM runtime_work_ownership WHERE family = ? FOR UPDATE
-- name: ownership_insert
INSERT INTO runtime_work_ownership (family, generation, owner, taken_at_ms) VALUES (?, ?, ?, ?)
-- name: ownership_update
UPDATE runtime_work_ownership SET generation = ?, owner = ?, taken_at_ms = ? WHERE family = ? AND generation < ?
-- name: fence_insert
INSERT INTO runtime_work_fence (family, generation) VALUES (?, ?)
-- name: fence_update
UPDATE runtime_work_fence SET generation = ? WHERE family = ? AND generation < ?
-- A shared lock on the fence row inside every claim and disposition transaction.
-- name: fence_read
SELECT generation FROM runtime_work_fence WHERE family = ? LOCK IN SHARE MODE
-- TiDB treats LOCK IN SHARE MODE as a no-op unless noop functions are enabled, so on TiDB the
-- fence read takes an exclusive pessimistic lock; a lost pessimistic lock is still caught by the
-- claim-token compare-and-set every commit carries.
-- name: fence_read_tidb
SELECT generation FROM runtime_work_fence WHERE family = ? FOR UPDATE
