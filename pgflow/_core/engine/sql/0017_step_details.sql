-- What an operator reads of a step after the fact (`pgflow workflows show`, the dashboard): when it
-- started, so its duration is finished_at - started_at, and the error of every attempt that failed
-- before the last (the last one's is the step's own error).
--
-- An attempt's start is noted in step_attempts before it runs; the row keeps the start of the first
-- attempt of its execution, and the step's record takes it.
-- (Rows noted before this migration keep NULL: their start was not seen.)
ALTER TABLE {schema}.step_attempts ADD COLUMN started_at timestamptz;
ALTER TABLE {schema}.step_attempts ALTER COLUMN started_at SET DEFAULT now();
ALTER TABLE {schema}.steps ADD COLUMN started_at timestamptz;

-- One row per failed attempt that was retried. Bounded: the message and traceback are cut before
-- they are written (outcomes.attempt_error), and a step keeps its latest few rows only. No foreign
-- key (a trigger per insert for nothing: the insert is fenced by the workflow row); pruning, a
-- resume and the retention service delete the rows with their workflow or step.
CREATE TABLE {schema}.step_errors (
    workflow_id   text NOT NULL,
    position      integer NOT NULL,
    run           integer NOT NULL,   -- pgflow.attempt() of the execution that made the attempt
    step_attempt  integer NOT NULL,   -- pgflow.step_attempt() of the attempt in that execution
    error         jsonb NOT NULL,
    failed_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow_id, position, run, step_attempt)
);

-- A worker's lease, so `pgflow workers` can tell a dead worker (its heartbeat older than its lease:
-- its workflows are anybody's to take) from a live one. NULL for workers of versions before this.
ALTER TABLE {schema}.workers ADD COLUMN lease double precision;
