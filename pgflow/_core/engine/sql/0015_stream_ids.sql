-- Streams get a bigint id. A chunk was keyed by (workflow_id, key, position), two text columns in
-- every index entry and every comparison of the batch insert; now each stream is named once in
-- stream_ids, and chunks are keyed (stream_id, position). Writers and readers resolve a stream's
-- id once and keep it. No foreign keys, as in 0004: chunks are written only for a workflow their
-- writer holds (the fenced insert checks the workflow row), and pruning deletes all three together.

-- Nobody writes chunks by the old name while they are copied (workers of the version before may
-- still run): they wait for this migration, then write through the view below.
LOCK TABLE {schema}.streams IN ACCESS EXCLUSIVE MODE;

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

-- Workers of the versions before this one go on writing, reading and pruning chunks by the old name
-- until they are replaced (the first worker of the new version applies this migration while the
-- others still run): the view takes their inserts and deletes, so a rolling upgrade fails no stream.
CREATE FUNCTION {schema}.streams_by_old_name() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    sid bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO {schema}.stream_ids (workflow_id, key) VALUES (NEW.workflow_id, NEW.key)
            ON CONFLICT (workflow_id, key) DO NOTHING;
        SELECT id INTO sid FROM {schema}.stream_ids WHERE workflow_id = NEW.workflow_id AND key = NEW.key;
        -- Their retry after a lost connection inserts with ON CONFLICT DO NOTHING, which does not
        -- reach a trigger's own insert: a chunk already there is skipped here for them.
        INSERT INTO {schema}.chunks (stream_id, position, value) VALUES (sid, NEW.position, NEW.value)
            ON CONFLICT (stream_id, position) DO NOTHING;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        RETURN NEW;
    END IF;
    DELETE FROM {schema}.chunks c USING {schema}.stream_ids i
        WHERE c.stream_id = i.id AND i.workflow_id = OLD.workflow_id AND i.key = OLD.key
        AND c.position = OLD.position;
    RETURN OLD;
END $$;
CREATE TRIGGER streams_by_old_name INSTEAD OF INSERT OR DELETE ON {schema}.streams
    FOR EACH ROW EXECUTE FUNCTION {schema}.streams_by_old_name();
