-- Producers: one multi-row insert in the producer's transaction (the tuples are appended).
-- name: record_prefix
INSERT INTO audit_event (event_id, subject, kind, actor, at, body) VALUES

-- Delivery: one holder at a time (the lease row), events in sequence order.
-- name: lease_lock
SELECT holder, lease_until FROM audit_delivery WHERE id = 1 FOR UPDATE
-- name: lease_take
UPDATE audit_delivery SET holder = $1, lease_until = $2 WHERE id = 1
-- Inspection: every event, delivered or not, in sequence order.
-- name: stored
SELECT seq, event_id, subject, kind, actor, at, body FROM audit_event ORDER BY seq
-- name: pending
SELECT seq, event_id, subject, kind, actor, at, body FROM audit_event
WHERE delivered_at IS NULL ORDER BY seq LIMIT $1
-- name: delivered_prefix
UPDATE audit_event SET delivered_at = $1 WHERE delivered_at IS NULL AND event_id IN

-- next_work_at: whether an event waits, and who holds the delivery lease until when.
-- name: next_pending
SELECT (SELECT COUNT(*) FROM (SELECT 1 FROM audit_event WHERE delivered_at IS NULL LIMIT 1) t),
    holder, lease_until FROM audit_delivery WHERE id = 1

-- Observations.
-- name: undelivered
SELECT COUNT(*), MIN(at) FROM audit_event WHERE delivered_at IS NULL
-- name: generation
SELECT (SELECT MAX(seq) FROM audit_event), (SELECT MAX(generation) FROM runtime_work_fence WHERE family = 'audit')
