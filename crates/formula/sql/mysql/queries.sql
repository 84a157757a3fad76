-- Formula View family, MySQL dialect (MariaDB, MySQL, TiDB). Times are epoch milliseconds from the worker's clock.

-- Definitions (producer API). Versions come from one epoch row, so they only grow, even across
-- a drop and a re-define.
-- name: def_list
SELECT name, target, expression, version, updated_at FROM formula_definition ORDER BY name
-- name: def_get
SELECT name, target, expression, version, updated_at FROM formula_definition WHERE name = ?
-- name: def_upsert
INSERT INTO formula_definition (name, target, expression, version, updated_at) VALUES (?, ?, ?, ?, ?)
ON DUPLICATE KEY UPDATE target = VALUES(target), expression = VALUES(expression), version = VALUES(version), updated_at = VALUES(updated_at)
-- name: def_delete
DELETE FROM formula_definition WHERE name = ?
-- name: epoch_bump
UPDATE formula_epoch SET version = version + 1 WHERE id = 1
-- name: epoch_read
SELECT version FROM formula_epoch WHERE id = 1
-- An attempt derives under a share lock on the epoch, so a define (which updates it) is
-- ordered before or after every derivation, never in the middle of one.
-- name: epoch_share
SELECT version FROM formula_epoch WHERE id = 1 LOCK IN SHARE MODE

-- The change cursor ('changes': the last crm_record_change id ingested; 'epoch': the epoch
-- whose stale records are all marked). Locked by every claim, so ingestion is serial.
-- name: cursor_lock
SELECT name, position FROM formula_cursor ORDER BY name FOR UPDATE
-- name: cursor_set
INSERT INTO formula_cursor (name, position) VALUES (?, ?) ON DUPLICATE KEY UPDATE position = VALUES(position)
-- name: cursor_init
INSERT IGNORE INTO formula_cursor (name, position) VALUES (?, ?)
-- name: cursor_insert_prefix
INSERT IGNORE INTO formula_cursor (name, position) VALUES
-- name: cursor_insert_suffix

-- name: cursor_delete_prefix
DELETE FROM formula_cursor WHERE name IN

-- Marking records due (multi-row; a claimed row is taken back, its attempt's writes then miss).
-- name: due_upsert_prefix
INSERT INTO formula_record (record_key, source_revision, epoch, due_at) VALUES
-- name: due_upsert_suffix
ON DUPLICATE KEY UPDATE due_at = VALUES(due_at), claim_token = NULL
-- name: mark_epoch
UPDATE formula_record SET due_at = ? WHERE epoch < ? AND due_at IS NULL LIMIT ?

-- Claim: one statement over formula_record_due.
-- name: claim
UPDATE formula_record SET claim_token = ?, due_at = ?, owner_generation = ?, attempts = attempts + 1
WHERE due_at <= ? ORDER BY due_at LIMIT ?
-- name: claimed
SELECT record_key FROM formula_record WHERE claim_token = ?

-- Attempt statements (the key lists are appended).
-- name: lock_claimed_prefix
SELECT record_key, source_revision, account, contribution FROM formula_record WHERE claim_token = ? AND record_key IN
-- name: lock_suffix
FOR UPDATE
-- name: values_delete_prefix
DELETE FROM formula_value WHERE record_key IN
-- name: value_insert_prefix
INSERT INTO formula_value (record_key, formula, value, error, source_revision, definition_version, digest) VALUES
-- name: derived_upsert_prefix
INSERT INTO formula_record (record_key, source_revision, epoch, account, contribution, errors, derived_at) VALUES
-- name: derived_upsert_suffix
ON DUPLICATE KEY UPDATE source_revision = VALUES(source_revision), epoch = VALUES(epoch), account = VALUES(account),
    contribution = VALUES(contribution), errors = VALUES(errors), derived_at = VALUES(derived_at)
-- name: derived_delete
DELETE FROM formula_record WHERE record_key = ? AND claim_token = ?
-- name: rollup_add
INSERT INTO formula_rollup (account, total, records) VALUES (?, ?, ?)
ON DUPLICATE KEY UPDATE total = total + VALUES(total), records = records + VALUES(records)
-- name: heartbeat_prefix
UPDATE formula_record SET due_at = ? WHERE claim_token = ? AND record_key IN
-- name: release_prefix
UPDATE formula_record SET due_at = NULL, claim_token = NULL WHERE claim_token = ? AND epoch = ? AND record_key IN
-- name: unclaim_prefix
UPDATE formula_record SET due_at = ?, claim_token = NULL WHERE claim_token = ? AND record_key IN

-- Reconcile: leases of older generations back at once.
-- name: release_older
UPDATE formula_record SET claim_token = NULL, due_at = ? WHERE claim_token IS NOT NULL AND owner_generation < ?

-- next_work_at: the earliest due record (an index MIN), and "now" while the change log or a
-- definition change is ahead of the cursor.
-- name: next_due
SELECT MIN(due_at) FROM formula_record
-- name: next_backlog
SELECT CASE WHEN COALESCE((SELECT MAX(id) FROM crm_record_change), 0) > COALESCE((SELECT position FROM formula_cursor WHERE name = 'changes'), -1)
    OR (SELECT version FROM formula_epoch WHERE id = 1) > COALESCE((SELECT position FROM formula_cursor WHERE name = 'epoch'), 0)
    THEN CAST(0 AS SIGNED) END

-- The polled generation cursor (and the probe's start read).
-- name: generation
SELECT (SELECT MAX(id) FROM crm_record_change), (SELECT version FROM formula_epoch WHERE id = 1),
    (SELECT MAX(generation) FROM runtime_work_fence WHERE family = 'formula'),
    (SELECT CAST(COALESCE(SUM(seq), 0) AS SIGNED) FROM runtime_work_signal WHERE family = 'records')

-- Convergence sweep, in key-ordered chunks: a LEFT JOIN over primary keys each way
-- (canonical records missing or stale in the view; view rows whose record is gone), the
-- value rows of the chunk, and the roll-up against its canonical aggregate per account.
-- name: sweep_records
SELECT r.record_key, r.revision, f.source_revision, f.epoch, f.due_at FROM crm_record r
LEFT JOIN formula_record f ON f.record_key = r.record_key
WHERE r.record_key > ? ORDER BY r.record_key LIMIT ?
-- name: sweep_view
SELECT f.record_key, f.source_revision, f.epoch, f.due_at, r.revision FROM formula_record f
LEFT JOIN crm_record r ON r.record_key = f.record_key
WHERE f.record_key > ? ORDER BY f.record_key LIMIT ?
-- name: sweep_values
SELECT record_key, formula, value, error, source_revision, definition_version, digest FROM formula_value
WHERE record_key > ? AND record_key <= ? ORDER BY record_key, formula
-- name: sweep_values_tail
SELECT record_key, formula, value, error, source_revision, definition_version, digest FROM formula_value
WHERE record_key > ? ORDER BY record_key, formula LIMIT ?
-- The roll-up chunk is bounded by records, not accounts: the account at record offset
-- chunk - 1 after the cursor (an index-only range over formula_record_account) closes the range,
-- so no chunk aggregates more than `chunk` records plus the rest of its last account.
-- name: sweep_rollup_bound
SELECT account FROM formula_record WHERE account > ? ORDER BY account LIMIT 1 OFFSET ?
-- name: sweep_rollup_canonical
SELECT account, CAST(SUM(contribution) AS SIGNED), COUNT(*) FROM formula_record
WHERE account > ? AND account <= ? GROUP BY account ORDER BY account
-- The last range (fewer than `chunk` records after the cursor).
-- name: sweep_rollup_canonical_tail
SELECT account, CAST(SUM(contribution) AS SIGNED), COUNT(*) FROM formula_record
WHERE account > ? GROUP BY account ORDER BY account
-- name: sweep_rollup_stored
SELECT account, total, records FROM formula_rollup WHERE account > ? AND account <= ? ORDER BY account
-- name: sweep_rollup_stored_tail
SELECT account, total, records FROM formula_rollup WHERE account > ? ORDER BY account LIMIT ?
-- Repair of one account: its roll-up row locked first, then its canonical sum read fresh.
-- name: rollup_ensure
INSERT IGNORE INTO formula_rollup (account, total, records) VALUES (?, 0, 0)
-- name: rollup_lock
SELECT total FROM formula_rollup WHERE account = ? FOR UPDATE
-- name: rollup_sum
SELECT CAST(COALESCE(SUM(contribution), 0) AS SIGNED), COUNT(*) FROM formula_record WHERE account = ? LOCK IN SHARE MODE
-- name: rollup_set
UPDATE formula_rollup SET total = ?, records = ? WHERE account = ?
-- name: rollup_prune
DELETE FROM formula_rollup WHERE account = ? AND records = 0

-- Reads for people and observations.
-- name: values_of
SELECT formula, value, error, source_revision, definition_version FROM formula_value WHERE record_key = ? ORDER BY formula
-- name: record_of
SELECT source_revision, epoch, due_at, derived_at FROM formula_record WHERE record_key = ?
-- name: rollups
SELECT account, total, records FROM formula_rollup WHERE records <> 0 ORDER BY account LIMIT ?
-- name: stale_count
SELECT COUNT(*) FROM (SELECT 1 FROM formula_record WHERE due_at IS NOT NULL LIMIT ?) t
-- name: oldest_stale
SELECT MIN(due_at) FROM formula_record WHERE due_at IS NOT NULL AND claim_token IS NULL
-- name: error_count
SELECT COUNT(*) FROM (SELECT 1 FROM formula_record WHERE errors > 0 LIMIT ?) t
