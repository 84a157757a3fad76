-- Paused v2, MySQL dialect: an index on claim_token, so a claim's read-back (TiDB ignores
-- RETURNING) is an index lookup rather than a scan of paused_step.
CREATE INDEX IF NOT EXISTS paused_step_claim ON paused_step (claim_token, state);
