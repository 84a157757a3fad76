-- Formula View v1, PostgreSQL. Canonical records (crm_record, crm_record_change) belong to the
-- records domain (the Bulk crate); every table here is derived or the family's own bookkeeping.
CREATE TABLE IF NOT EXISTS formula_definition (
    name       VARCHAR(64)  NOT NULL PRIMARY KEY,
    target     VARCHAR(64)  NOT NULL,
    expression TEXT         NOT NULL,
    version    BIGINT       NOT NULL,
    updated_at BIGINT       NOT NULL
);
CREATE TABLE IF NOT EXISTS formula_epoch (
    id      INTEGER NOT NULL PRIMARY KEY,
    version BIGINT  NOT NULL
);
INSERT INTO formula_epoch (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
CREATE TABLE IF NOT EXISTS formula_cursor (
    name     VARCHAR(32) NOT NULL PRIMARY KEY,
    position BIGINT      NOT NULL
);
CREATE TABLE IF NOT EXISTS formula_record (
    record_key       VARCHAR(255) NOT NULL PRIMARY KEY,
    source_revision  BIGINT       NOT NULL,
    epoch            BIGINT       NOT NULL,
    account          VARCHAR(255),
    contribution     BIGINT       NOT NULL DEFAULT 0,
    errors           INTEGER      NOT NULL DEFAULT 0,
    due_at           BIGINT,
    claim_token      VARCHAR(64),
    owner_generation BIGINT       NOT NULL DEFAULT 0,
    attempts         BIGINT       NOT NULL DEFAULT 0,
    derived_at       BIGINT
);
CREATE INDEX IF NOT EXISTS formula_record_due ON formula_record (due_at);
CREATE INDEX IF NOT EXISTS formula_record_epoch ON formula_record (epoch);
CREATE INDEX IF NOT EXISTS formula_record_account ON formula_record (account, contribution);
CREATE INDEX IF NOT EXISTS formula_record_errors ON formula_record (errors);
CREATE TABLE IF NOT EXISTS formula_value (
    record_key         VARCHAR(255) NOT NULL,
    formula            VARCHAR(64)  NOT NULL,
    value              TEXT,
    error              TEXT,
    source_revision    BIGINT       NOT NULL,
    definition_version BIGINT       NOT NULL,
    digest             VARCHAR(32)  NOT NULL,
    PRIMARY KEY (record_key, formula)
);
CREATE TABLE IF NOT EXISTS formula_rollup (
    account VARCHAR(255) NOT NULL PRIMARY KEY,
    total   BIGINT       NOT NULL,
    records BIGINT       NOT NULL
);
