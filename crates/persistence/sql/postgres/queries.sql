-- Runtime work ownership and fence, PostgreSQL.
-- name: schema_create
CREATE TABLE IF NOT EXISTS nexuscrm_schema (component VARCHAR(64) NOT NULL PRIMARY KEY, version BIGINT NOT NULL)
-- name: schema_read
SELECT version FROM nexuscrm_schema WHERE component = $1
-- name: schema_insert
INSERT INTO nexuscrm_schema (component, version) VALUES ($1, $2)
-- name: schema_update
UPDATE nexuscrm_schema SET version = $1 WHERE component = $2
-- name: ownership_read
SELECT generation FROM runtime_work_ownership WHERE family = $1 FOR UPDATE
-- name: ownership_insert
INSERT INTO runtime_work_ownership (family, generation, owner, taken_at_ms) VALUES ($1, $2, $3, $4)
-- name: ownership_update
UPDATE runtime_work_ownership SET generation = $1, owner = $2, taken_at_ms = $3 WHERE family = $4 AND generation < $5
-- name: fence_insert
INSERT INTO runtime_work_fence (family, generation) VALUES ($1, $2)
-- name: fence_update
UPDATE runtime_work_fence SET generation = $1 WHERE family = $2 AND generation < $3
-- The fence check inside every claim and disposition transaction: FOR SHARE on one stripe
-- makes a concurrent takeover (which updates every stripe) wait for the commit, and makes this
-- read see a committed takeover.
-- name: fence_read
SELECT generation FROM runtime_work_fence_stripe WHERE family = $1 AND stripe = $2 FOR SHARE
-- A takeover writes every stripe (and locks each until it commits).
-- name: fence_stripe_upsert
INSERT INTO runtime_work_fence_stripe (family, stripe, generation) VALUES ($1, $2, $3)
ON CONFLICT (family, stripe) DO UPDATE SET generation = GREATEST(runtime_work_fence_stripe.generation, EXCLUDED.generation)
-- name: signal_bump
INSERT INTO runtime_work_signal (family, stripe, seq) VALUES ($1, $2, 1)
ON CONFLICT (family, stripe) DO UPDATE SET seq = runtime_work_signal.seq + 1
