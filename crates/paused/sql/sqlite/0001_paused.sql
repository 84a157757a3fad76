-- Paused Flow v1, SQLite: one row per paused step of a flow run. Only the SHA-256 of the
-- resume token is stored.
CREATE TABLE IF NOT EXISTS paused_step (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    run_ref          VARCHAR(255) NOT NULL,
    step             VARCHAR(255) NOT NULL,
    token_hash       VARCHAR(64)  NOT NULL,
    state            VARCHAR(16)  NOT NULL,
    payload          TEXT         NOT NULL,
    resume_payload   TEXT,
    resume_digest    VARCHAR(64)  NOT NULL DEFAULT '',
    timeout_at       BIGINT       NOT NULL,
    resumed_at       BIGINT,
    claim_token      VARCHAR(64),
    lease_expires_at BIGINT,
    owner_generation BIGINT       NOT NULL DEFAULT 0,
    attempts         BIGINT       NOT NULL DEFAULT 0,
    available_at     BIGINT       NOT NULL DEFAULT 0,
    effect_key       VARCHAR(64)  NOT NULL,
    intent_at        BIGINT,
    intent_attempt   BIGINT,
    outcome          TEXT,
    finished_at      BIGINT,
    resolved_at      BIGINT,
    created_at       BIGINT       NOT NULL,
    updated_at       BIGINT       NOT NULL,
    CONSTRAINT paused_step_token UNIQUE (token_hash),
    CONSTRAINT paused_step_run_step UNIQUE (run_ref, step)
);
CREATE INDEX IF NOT EXISTS paused_step_timeout ON paused_step (state, timeout_at);
CREATE INDEX IF NOT EXISTS paused_step_lease ON paused_step (state, lease_expires_at);
CREATE INDEX IF NOT EXISTS paused_step_available ON paused_step (state, available_at);
