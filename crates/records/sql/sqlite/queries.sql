-- The records domain's read path (crm_record and its change log, whose schema Bulk's migrations own),
-- for derived families (Formula View): records by key, and the change log after a cursor
-- (indexed by its primary key).
-- name: records_read_prefix
SELECT record_key, revision, data FROM crm_record WHERE record_key IN
-- name: changes_after
SELECT id, record_key FROM crm_record_change WHERE id > ? ORDER BY id LIMIT ?
-- name: change_max
SELECT MAX(id) FROM crm_record_change
-- name: changes_with_ids_prefix
SELECT id, record_key FROM crm_record_change WHERE id IN
