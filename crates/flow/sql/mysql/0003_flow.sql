-- Flow v3, MySQL dialect: an index on claim_token, so a claim's read-back (TiDB ignores
-- RETURNING) is an index lookup rather than a scan of flow_schedule.
CREATE INDEX IF NOT EXISTS flow_schedule_claim ON flow_schedule (claim_token);
