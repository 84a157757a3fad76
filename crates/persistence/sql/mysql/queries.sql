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
-- The fence check inside every claim and disposition transaction: a shared lock on one stripe.
-- name: fence_read
SELECT generation FROM runtime_work_fence_stripe WHERE family = ? AND stripe = ? LOCK IN SHARE MODE
-- TiDB treats LOCK IN SHARE MODE as a no-op unless noop functions are enabled, so on TiDB the
-- fence read takes an exclusive pessimistic lock, on one stripe of sixteen so that a family's
-- writers do not all queue on one row; a lost pessimistic lock is still caught by the
-- claim-token compare-and-set every commit carries.
-- name: fence_read_tidb
SELECT generation FROM runtime_work_fence_stripe WHERE family = ? AND stripe = ? FOR UPDATE
-- A takeover writes every stripe (and locks each until it commits).
-- name: fence_stripe_upsert
INSERT INTO runtime_work_fence_stripe (family, stripe, generation) VALUES (?, ?, ?)
ON DUPLICATE KEY UPDATE generation = GREATEST(generation, VALUES(generation))
-- name: signal_bump
INSERT INTO runtime_work_signal (family, stripe, seq) VALUES (?, ?, 1) ON DUPLICATE KEY UPDATE seq = seq + 1
