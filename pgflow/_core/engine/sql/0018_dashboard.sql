-- The dashboard's workflow list: newest first, a page at a time, continuing after the last row shown
-- (keyset pagination on created_at, id), filtered by status, name or queue. Each filter has an index
-- in that order, so a page reads as many index entries as it shows, however many rows the table has.
-- (created_at, id) replaces workflows_created, whose ties on created_at had to be sorted.
CREATE INDEX workflows_created_id ON {schema}.workflows (created_at, id);
DROP INDEX {schema}.workflows_created;
CREATE INDEX workflows_status_created ON {schema}.workflows (status, created_at, id);
CREATE INDEX workflows_name_created ON {schema}.workflows (name, created_at, id);
CREATE INDEX workflows_queue_created ON {schema}.workflows (queue, created_at, id);

-- A workflow's page lists the messages it received, in the order they came, and those its body sent
-- without a key of their own, which are keyed "<sender id>.<journal position>": a prefix, found by a
-- range of the key in byte order.
CREATE INDEX messages_by_workflow ON {schema}.messages (workflow_id, id);
CREATE INDEX messages_by_sender ON {schema}.messages ((idempotency_key COLLATE "C"))
    WHERE idempotency_key IS NOT NULL;
