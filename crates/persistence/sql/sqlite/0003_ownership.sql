-- Ownership v3: the fence in 16 stripes, and the cross-node work signal.
--
-- A writer locks one stripe (chosen at random) of its family's fence inside its transaction; a
-- takeover writes all 16 in its own. Every writer still conflicts with every takeover, as with
-- one fence row, but writers conflict with each other on a sixteenth of the rows: on TiDB, where
-- the lock is exclusive (FOR UPDATE), one fence row would serialize a family's claims and
-- commits across every replica; on PostgreSQL it keeps FOR SHARE off one hot multixact.
CREATE TABLE IF NOT EXISTS runtime_work_fence_stripe (
    family     VARCHAR(64) NOT NULL,
    stripe     INT         NOT NULL,
    generation BIGINT      NOT NULL,
    PRIMARY KEY (family, stripe)
);
INSERT OR IGNORE INTO runtime_work_fence_stripe (family, stripe, generation)
SELECT f.family, s.n, f.generation FROM runtime_work_fence f CROSS JOIN (SELECT 0 AS n UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9 UNION ALL SELECT 10 UNION ALL SELECT 11 UNION ALL SELECT 12 UNION ALL SELECT 13 UNION ALL SELECT 14 UNION ALL SELECT 15) s;
-- A producer bumps one random stripe of its family's signal after each commit; a polled
-- generation probe reads the sum. Unlike MAX(id), the sum changes for every signalled commit
-- whatever id it got: auto-increment ids are neither commit-ordered on one server nor monotonic
-- across the nodes of a multi-primary cluster (Galera's offsets, TiDB's per-server caches).
CREATE TABLE IF NOT EXISTS runtime_work_signal (
    family VARCHAR(64) NOT NULL,
    stripe INT         NOT NULL,
    seq    BIGINT      NOT NULL,
    PRIMARY KEY (family, stripe)
);
