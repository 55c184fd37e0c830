-- Events: the last value a workflow published under each key. The journal entry that set it (a step
-- row named 'pgflow.set_event:<key>' holding the value) keeps a replay from publishing it again, and
-- lets a fork publish what its copied entries had.
CREATE TABLE {schema}.events (
    workflow_id  text NOT NULL REFERENCES {schema}.workflows (id) ON DELETE CASCADE,
    key          text NOT NULL,
    value        bytea NOT NULL,
    set_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow_id, key)
);
