-- Streams: each chunk is a row; a NULL value is the close marker. Positions are dense per
-- (workflow, key) and assigned by the single execution that holds the workflow's lease.

CREATE TABLE {schema}.streams (
    workflow_id  text NOT NULL REFERENCES {schema}.workflows (id) ON DELETE CASCADE,
    key          text NOT NULL,
    position     integer NOT NULL,
    value        bytea,
    PRIMARY KEY (workflow_id, key, position)
);

-- Where each recorded step left the workflow's streams, so a replay knows which positions the
-- step's writes took without running it again.
ALTER TABLE {schema}.steps ADD COLUMN stream_ends jsonb;
