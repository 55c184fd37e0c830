-- Streams get a bigint id. A chunk was keyed by (workflow_id, key, position), two text columns in
-- every index entry and every comparison of the batch insert; now each stream is named once in
-- stream_ids, and chunks are keyed (stream_id, position). Writers and readers resolve a stream's
-- id once and keep it. No foreign keys, as in 0004: chunks are written only for a workflow their
-- writer holds (the fenced insert checks the workflow row), and pruning deletes all three together.

CREATE TABLE {schema}.stream_ids (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    workflow_id  text NOT NULL,
    key          text NOT NULL,
    UNIQUE (workflow_id, key)
);

-- A NULL value is the close marker, always a stream's last chunk. Positions are dense per stream.
CREATE TABLE {schema}.chunks (
    stream_id  bigint NOT NULL,
    position   integer NOT NULL,
    value      bytea,
    PRIMARY KEY (stream_id, position)
);

-- An upgraded database keeps its chunks.
INSERT INTO {schema}.stream_ids (workflow_id, key)
    SELECT DISTINCT workflow_id, key FROM {schema}.streams ORDER BY workflow_id, key;
INSERT INTO {schema}.chunks (stream_id, position, value)
    SELECT i.id, s.position, s.value FROM {schema}.streams s
    JOIN {schema}.stream_ids i ON i.workflow_id = s.workflow_id AND i.key = s.key;
DROP TABLE {schema}.streams;

-- The chunks as they looked before, by workflow and key: for reading them by hand (pgflow psql).
CREATE VIEW {schema}.streams AS
    SELECT i.workflow_id, i.key, c.position, c.value
    FROM {schema}.stream_ids i JOIN {schema}.chunks c ON c.stream_id = i.id;
