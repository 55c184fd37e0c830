-- The workflow whose body started this one, so cancelling a parent cancels its children (and
-- theirs) too.
ALTER TABLE {schema}.workflows ADD COLUMN parent_id text;
CREATE INDEX workflows_parent ON {schema}.workflows (parent_id) WHERE parent_id IS NOT NULL;
