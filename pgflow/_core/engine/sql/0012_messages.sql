-- Messages sent to a workflow, each consumed once: the receive that takes one marks it consumed in
-- the same statement that journals it (consumed_position is that journal entry).
CREATE TABLE {schema}.messages (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workflow_id        text NOT NULL REFERENCES {schema}.workflows (id) ON DELETE CASCADE,
    topic              text NOT NULL,
    value              bytea NOT NULL,
    idempotency_key    text,
    sent_at            timestamptz NOT NULL DEFAULT now(),
    consumed_at        timestamptz,
    consumed_position  integer
);
-- The same idempotency key twice (per receiving workflow) stores one message.
CREATE UNIQUE INDEX messages_idempotency ON {schema}.messages (workflow_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- A receive reads the oldest unconsumed message of its topic.
CREATE INDEX messages_unread ON {schema}.messages (workflow_id, topic, id) WHERE consumed_at IS NULL;

-- A receive still waiting: its journal entry holds the deadline (wake_at) and no message yet.
ALTER TABLE {schema}.steps ADD COLUMN waiting boolean NOT NULL DEFAULT false;
-- The topic a workflow that gave its slot back waits on, so a send to it makes it due at once.
ALTER TABLE {schema}.workflows ADD COLUMN waiting_for text;
