-- Formula View v1, SQLite. Canonical records (crm_record, crm_record_change) belong to the
-- records domain (the Bulk crate); every table here is derived or the family's own bookkeeping.
CREATE TABLE IF NOT EXISTS formula_definition (
    name       TEXT  NOT NULL PRIMARY KEY,
    target     TEXT  NOT NULL,
    expression TEXT         NOT NULL,
    version    INTEGER       NOT NULL,
    updated_at INTEGER       NOT NULL
);
CREATE TABLE IF NOT EXISTS formula_epoch (
    id      INTEGER NOT NULL PRIMARY KEY,
    version INTEGER  NOT NULL
);
INSERT INTO formula_epoch (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
CREATE TABLE IF NOT EXISTS formula_cursor (
    name     TEXT NOT NULL PRIMARY KEY,
    position INTEGER      NOT NULL
);
CREATE TABLE IF NOT EXISTS formula_record (
    record_key       TEXT NOT NULL PRIMARY KEY,
    source_revision  INTEGER       NOT NULL,
    epoch            INTEGER       NOT NULL,
    account          TEXT,
    contribution     INTEGER       NOT NULL DEFAULT 0,
    errors           INTEGER      NOT NULL DEFAULT 0,
    due_at           INTEGER,
    claim_token      TEXT,
    owner_generation INTEGER       NOT NULL DEFAULT 0,
    attempts         INTEGER       NOT NULL DEFAULT 0,
    derived_at       INTEGER
);
CREATE INDEX IF NOT EXISTS formula_record_due ON formula_record (due_at);
CREATE INDEX IF NOT EXISTS formula_record_epoch ON formula_record (epoch);
CREATE INDEX IF NOT EXISTS formula_record_account ON formula_record (account, contribution);
CREATE INDEX IF NOT EXISTS formula_record_errors ON formula_record (errors);
CREATE TABLE IF NOT EXISTS formula_value (
    record_key         TEXT NOT NULL,
    formula            TEXT  NOT NULL,
    value              TEXT,
    error              TEXT,
    source_revision    INTEGER       NOT NULL,
    definition_version INTEGER       NOT NULL,
    digest             TEXT  NOT NULL,
    PRIMARY KEY (record_key, formula)
);
CREATE TABLE IF NOT EXISTS formula_rollup (
    account TEXT NOT NULL PRIMARY KEY,
    total   INTEGER       NOT NULL,
    records INTEGER       NOT NULL
);
