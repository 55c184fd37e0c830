-- The signal keys are for the roles that write pgflow's tables, not for every role that may read them.
-- A key lets its holder seal a payload every process believes: an end a caller's result() returns, a
-- chunk a reader shows. Read grants that people give every day (GRANT SELECT ON ALL TABLES IN SCHEMA,
-- default privileges, pg_read_all_data) would otherwise hand it to a role that can write nothing. So
-- the table shows its rows, and takes new ones, only to a role that may start or change workflows
-- (INSERT or UPDATE on workflows); any other role that reads it sees no key, and its processes wait
-- on their poll. Row-level security binds every role but the table's owner and superusers (who may
-- write the tables themselves anyway); pg_read_all_data does not pass it.
ALTER TABLE {schema}.signal_keys ENABLE ROW LEVEL SECURITY;

CREATE POLICY writers_only ON {schema}.signal_keys
    USING (has_table_privilege('{schema}.workflows'::regclass, 'INSERT, UPDATE'))
    WITH CHECK (has_table_privilege('{schema}.workflows'::regclass, 'INSERT, UPDATE'));
