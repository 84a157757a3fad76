CREATE TABLE IF NOT EXISTS audit_event (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id     TEXT    NOT NULL UNIQUE,
    subject      TEXT    NOT NULL,
    kind         TEXT    NOT NULL,
    actor        TEXT    NOT NULL,
    at           INTEGER NOT NULL,
    body         TEXT    NOT NULL,
    delivered_at INTEGER
);
CREATE INDEX IF NOT EXISTS audit_event_pending ON audit_event (delivered_at, seq);
CREATE TABLE IF NOT EXISTS audit_delivery (
    id          INTEGER NOT NULL PRIMARY KEY,
    holder      TEXT    NOT NULL,
    lease_until INTEGER NOT NULL
);
INSERT OR IGNORE INTO audit_delivery (id, holder, lease_until) VALUES (1, '', 0);
