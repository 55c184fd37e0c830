-- Every attempt of a step is counted, interrupted ones included: an attempt notes its start here
-- (one row per step and execution, so a retried statement cannot count twice), and the step's
-- record takes the sum when it is written (and the rows go). Rows of steps a workflow's end cut
-- short go with a resume or with the workflow.
CREATE TABLE {schema}.step_attempts (
    workflow_id  text NOT NULL,
    position     integer NOT NULL,
    attempt      integer NOT NULL,  -- the workflow's claim attempt of the execution that ran it
    tries        integer NOT NULL,  -- attempts that execution started
    PRIMARY KEY (workflow_id, position, attempt)
);

-- The W3C traceparent of the span that started the workflow (NULL without tracing): the worker that
-- claims it, the first or one taking over after a crash, continues the caller's trace.
ALTER TABLE {schema}.workflows ADD COLUMN traceparent text;
