CREATE TABLE IF NOT EXISTS audit_event (
    seq          BIGINT AUTO_INCREMENT PRIMARY KEY,
    event_id     VARCHAR(191) NOT NULL,
    subject      VARCHAR(255) NOT NULL,
    kind         VARCHAR(64)  NOT NULL,
    actor        VARCHAR(255) NOT NULL,
    at           BIGINT       NOT NULL,
    body         TEXT         NOT NULL,
    delivered_at BIGINT       NULL,
    UNIQUE KEY audit_event_id (event_id)
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE INDEX IF NOT EXISTS audit_event_pending ON audit_event (delivered_at, seq);
CREATE TABLE IF NOT EXISTS audit_delivery (
    id          BIGINT       NOT NULL PRIMARY KEY,
    holder      VARCHAR(255) NOT NULL,
    lease_until BIGINT       NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
INSERT IGNORE INTO audit_delivery (id, holder, lease_until) VALUES (1, '', 0);
