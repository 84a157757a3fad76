-- Paused Flow v1, MySQL dialect: one row per paused step of a flow run. Only the SHA-256 of
-- the resume token is stored. Byte-exact utf8mb4 (COLLATE utf8mb4_bin is replaced by the
-- server's NO PAD binary collation at migration time).
CREATE TABLE IF NOT EXISTS paused_step (
    id               BIGINT AUTO_INCREMENT PRIMARY KEY,
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
    CONSTRAINT paused_step_run_step UNIQUE (run_ref, step),
    INDEX paused_step_timeout (state, timeout_at),
    INDEX paused_step_lease (state, lease_expires_at),
    INDEX paused_step_available (state, available_at)
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
