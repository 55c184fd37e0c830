-- The schema's clock. Every time pgflow's statements read for a workflow (due times, wake-ups,
-- message deadlines, workflow timeouts, when a step or a workflow finished, retention) is clock_now().
-- Here it is now(): a LANGUAGE sql function of one expression, STABLE, with no SET clause, which the
-- planner inlines, so every statement plans and runs exactly as it did with now() (the claim keeps
-- its index scans). pgflow.testing replaces the body with now() plus an offset to move a test's time;
-- a plan that inlined the old body is invalidated by the replacement. Leases, heartbeats, rate limits
-- and the signal keys stay on now(): they measure processes, not workflows.
-- (A clock row read by the function would cost every statement a subquery: a function with a
-- subquery is not inlined.)
CREATE OR REPLACE FUNCTION {schema}.clock_now() RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE AS 'SELECT pg_catalog.now()';

ALTER TABLE {schema}.workflows ALTER COLUMN due_at SET DEFAULT {schema}.clock_now(),
    ALTER COLUMN created_at SET DEFAULT {schema}.clock_now();
ALTER TABLE {schema}.steps ALTER COLUMN finished_at SET DEFAULT {schema}.clock_now();
ALTER TABLE {schema}.events ALTER COLUMN set_at SET DEFAULT {schema}.clock_now();
ALTER TABLE {schema}.messages ALTER COLUMN sent_at SET DEFAULT {schema}.clock_now();
