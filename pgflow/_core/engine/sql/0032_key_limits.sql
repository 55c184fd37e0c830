-- Per-key limits (app.queue(..., key_concurrency=, key_rate_limit=), with_options(key=)).
--
-- key: what a start counts against in a queue with per-key limits (a tenant, a user, a document). ''
-- for a start without one (the API refuses an empty key, so '' is free to mean "no key"): in a queue
-- with per-key limits the workflows without a key share that one key. NOT NULL with a constant default
-- is a change of the catalog alone (no rewrite of the table), and lets every statement compare keys with
-- = and > rather than handle NULL apart. COLLATE "C": keys are compared byte by byte, the cheapest
-- comparison and one whose order no locale can change under the index.
ALTER TABLE {schema}.workflows ADD COLUMN key text COLLATE "C" NOT NULL DEFAULT '';

-- A key-limited claim walks the keys that have queued work (one probe of this index per key, skipping
-- from each key to the next) and reads a key's own queue in priority and due order. Over every queued
-- row, not only keyed ones: the workflows without a key in a key-limited queue are one of its keys.
CREATE INDEX workflows_queued_by_key ON {schema}.workflows (queue, key, priority DESC, due_at)
    WHERE status = 'queued';

-- A queue's per-key limits (NULL: none), beside its own. rate_period (per=) is shared by both rates.
-- key_cursor: the key the queue's last full claim round ended at; the next round's turns begin after
-- it, so that over rounds every key gets its turn (NULL: from the first key).
ALTER TABLE {schema}.queues ADD COLUMN key_concurrency integer CHECK (key_concurrency > 0);
ALTER TABLE {schema}.queues ADD COLUMN key_rate_limit integer CHECK (key_rate_limit > 0);
ALTER TABLE {schema}.queues ADD COLUMN key_cursor text COLLATE "C";

-- The token bucket of each key of a queue with a per-key rate, as queues.tokens is the queue's: the
-- tokens it had at refilled_at (it refills at key_rate_limit per rate_period, up to key_rate_limit). A
-- key without a row has a full bucket, so the retention pass deletes the rows of full buckets and the
-- table holds about the keys that started work within the last period.
CREATE TABLE {schema}.queue_keys (
    queue        text NOT NULL,
    key          text COLLATE "C" NOT NULL,
    tokens       double precision NOT NULL,
    refilled_at  timestamptz NOT NULL,
    PRIMARY KEY (queue, key)
);
