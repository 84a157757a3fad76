CREATE TABLE IF NOT EXISTS flow_schedule (
    id                 BIGINT AUTO_INCREMENT PRIMARY KEY,
    name               VARCHAR(255) NOT NULL UNIQUE,
    flow               VARCHAR(255) NOT NULL,
    spec_kind          VARCHAR(16)  NOT NULL,
    cron_expr          VARCHAR(255) NOT NULL DEFAULT '',
    zone               VARCHAR(64)  NOT NULL DEFAULT '',
    interval_ms        BIGINT       NOT NULL DEFAULT 0,
    anchor_at          BIGINT       NOT NULL DEFAULT 0,
    policy             VARCHAR(16)  NOT NULL,
    catch_up_max       BIGINT       NOT NULL,
    state              VARCHAR(16)  NOT NULL,
    version            BIGINT       NOT NULL,
    next_occurrence_at BIGINT,
    claim_token        VARCHAR(64),
    lease_expires_at   BIGINT,
    owner_generation   BIGINT       NOT NULL DEFAULT 0,
    last_occurrence_at BIGINT,
    runs               BIGINT       NOT NULL DEFAULT 0,
    defined_at         BIGINT       NOT NULL,
    created_at         BIGINT       NOT NULL,
    updated_at         BIGINT       NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE INDEX IF NOT EXISTS flow_schedule_due ON flow_schedule (state, next_occurrence_at);
CREATE INDEX IF NOT EXISTS flow_schedule_lease ON flow_schedule (state, lease_expires_at);
CREATE INDEX IF NOT EXISTS flow_schedule_defined ON flow_schedule (defined_at);
CREATE TABLE IF NOT EXISTS flow_run (
    id               BIGINT AUTO_INCREMENT PRIMARY KEY,
    schedule_id      BIGINT       NOT NULL,
    flow             VARCHAR(255) NOT NULL,
    occurrence_at    BIGINT       NOT NULL,
    reserved_at      BIGINT       NOT NULL,
    schedule_version BIGINT       NOT NULL,
    owner_generation BIGINT       NOT NULL,
    state            VARCHAR(16)  NOT NULL,
    CONSTRAINT flow_run_occurrence UNIQUE (schedule_id, occurrence_at)
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
