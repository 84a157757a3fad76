CREATE TABLE IF NOT EXISTS runtime_work_ownership (
    family      VARCHAR(64)  NOT NULL PRIMARY KEY,
    generation  BIGINT       NOT NULL,
    owner       VARCHAR(255) NOT NULL,
    taken_at_ms BIGINT       NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
CREATE TABLE IF NOT EXISTS runtime_work_fence (
    family     VARCHAR(64) NOT NULL PRIMARY KEY,
    generation BIGINT      NOT NULL
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
