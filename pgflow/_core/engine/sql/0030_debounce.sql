-- Debounced starts (with_options(debounce=..., debounce_key=...)): per workflow name and key, the run
-- that the starts of the current burst collapse into, and when the burst began (its first start, on
-- the schema's clock: the run is due at the latest debounce_max seconds after it). A row is only a
-- pointer: the run is pending while its workflow is queued and was never claimed (started_at IS NULL);
-- once claimed, cancelled or gone, the row is stale, replaced by the key's next start and deleted by
-- the retention pass. No foreign key: deleting finished workflows should not pay for a lookup here.
CREATE TABLE {schema}.debounces (
    name         text NOT NULL,
    key          text NOT NULL,
    workflow_id  text NOT NULL,
    first_at     timestamptz NOT NULL,
    PRIMARY KEY (name, key)
);
