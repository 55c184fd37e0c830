-- Queues an operator paused (pgflow queues pause NAME, app.pause_queue): their workflows are not claimed
-- until resumed; running ones finish and starts still queue. A row per paused queue, so a claim's look
-- costs one probe of a table that is almost always empty.
CREATE TABLE {schema}.paused_queues (
    name       text PRIMARY KEY,
    paused_at  timestamptz NOT NULL DEFAULT now()
);
