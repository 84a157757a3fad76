CREATE TABLE IF NOT EXISTS bulk_job (
    id               BIGINT AUTO_INCREMENT PRIMARY KEY,
    idempotency_key  VARCHAR(255) NOT NULL UNIQUE,
    state            VARCHAR(16)  NOT NULL,
    claim_token      VARCHAR(64),
    lease_expires_at BIGINT,
    owner_generation BIGINT       NOT NULL DEFAULT 0,
    attempts         BIGINT       NOT NULL DEFAULT 0,
    max_attempts     BIGINT       NOT NULL,
    run_at           BIGINT       NOT NULL,
    cursor_ordinal   BIGINT       NOT NULL DEFAULT 0,
    total_rows       BIGINT       NOT NULL,
    applied_rows     BIGINT       NOT NULL DEFAULT 0,
    rejected_rows    BIGINT       NOT NULL DEFAULT 0,
    segment_size     BIGINT       NOT NULL,
    last_error       TEXT,
    created_at       BIGINT       NOT NULL,
    updated_at       BIGINT       NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE INDEX IF NOT EXISTS bulk_job_due ON bulk_job (state, run_at);
CREATE INDEX IF NOT EXISTS bulk_job_lease ON bulk_job (state, lease_expires_at);
CREATE TABLE IF NOT EXISTS bulk_input (
    job_id     BIGINT       NOT NULL,
    ordinal    BIGINT       NOT NULL,
    record_key VARCHAR(255) NOT NULL,
    fields     TEXT         NOT NULL,
    PRIMARY KEY (job_id, ordinal)
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE TABLE IF NOT EXISTS bulk_row_error (
    job_id  BIGINT NOT NULL,
    ordinal BIGINT NOT NULL,
    message TEXT   NOT NULL,
    PRIMARY KEY (job_id, ordinal)
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE TABLE IF NOT EXISTS crm_record (
    record_key VARCHAR(255) NOT NULL PRIMARY KEY,
    revision   BIGINT       NOT NULL,
    data       TEXT         NOT NULL,
    updated_at BIGINT       NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE TABLE IF NOT EXISTS crm_record_change (
    id         BIGINT AUTO_INCREMENT PRIMARY KEY,
    job_id     BIGINT       NOT NULL,
    ordinal    BIGINT       NOT NULL,
    record_key VARCHAR(255) NOT NULL,
    revision   BIGINT       NOT NULL,
    applied_at BIGINT       NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE INDEX IF NOT EXISTS crm_record_change_job ON crm_record_change (job_id, ordinal);
