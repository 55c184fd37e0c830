-- A chunk is only written for a workflow its writer holds (the fenced insert joins the workflow row),
-- so the foreign key on streams adds a trigger per chunk and no protection; it goes.
ALTER TABLE {schema}.streams DROP CONSTRAINT IF EXISTS streams_workflow_id_fkey;
