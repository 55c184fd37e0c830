-- The workflow names each live worker can run, so an operator can see queued workflows nobody runs.
ALTER TABLE {schema}.workers ADD COLUMN names text[] NOT NULL DEFAULT '{}';
