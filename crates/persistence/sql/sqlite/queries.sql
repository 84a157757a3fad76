-- Runtime work ownership and fence, SQLite. Writes run inside BEGIN IMMEDIATE (one writer).
-- name: schema_create
CREATE TABLE IF NOT EXISTS nexuscrm_schema (component VARCHAR(64) NOT NULL PRIMARY KEY, version BIGINT NOT NULL)
-- name: schema_read
SELECT version FROM nexuscrm_schema WHERE component = ?
-- name: schema_insert
INSERT INTO nexuscrm_schema (component, version) VALUES (?, ?)
-- name: schema_update
UPDATE nexuscrm_schema SET version = ? WHERE component = ?
-- name: ownership_read
SELECT generation FROM runtime_work_ownership WHERE family = ?
-- name: ownership_insert
INSERT INTO runtime_work_ownership (family, generation, owner, taken_at_ms) VALUES (?, ?, ?, ?)
-- name: ownership_update
UPDATE runtime_work_ownership SET generation = ?, owner = ?, taken_at_ms = ? WHERE family = ? AND generation < ?
-- name: fence_insert
INSERT INTO runtime_work_fence (family, generation) VALUES (?, ?)
-- name: fence_update
UPDATE runtime_work_fence SET generation = ? WHERE family = ? AND generation < ?
-- name: fence_read
SELECT generation FROM runtime_work_fence_stripe WHERE family = ? AND stripe = ?
-- name: fence_stripe_upsert
INSERT INTO runtime_work_fence_stripe (family, stripe, generation) VALUES (?, ?, ?)
ON CONFLICT (family, stripe) DO UPDATE SET generation = MAX(generation, excluded.generation)
-- name: signal_bump
INSERT INTO runtime_work_signal (family, stripe, seq) VALUES (?, ?, 1)
ON CONFLICT (family, stripe) DO UPDATE SET seq = seq + 1
