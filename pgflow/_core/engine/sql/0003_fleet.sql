-- What a fleet of workers needs: a registry of live workers, queue limits that hold across all of
-- them, and workflow timeouts.

CREATE TABLE {schema}.workers (
    id            text PRIMARY KEY,
    host          text NOT NULL,
    pid           integer NOT NULL,
    queues        text[] NOT NULL,
    version       text NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);

-- A queue row exists only for queues with limits. Claims from a limited queue lock its row, so the
-- limits hold across every worker; the rate limit is a token bucket refilled by elapsed time.
CREATE TABLE {schema}.queues (
    name         text PRIMARY KEY,
    concurrency  integer CHECK (concurrency > 0),
    rate_limit   integer CHECK (rate_limit > 0),
    rate_period  double precision CHECK (rate_period > 0),
    tokens       double precision NOT NULL DEFAULT 0,
    refilled_at  timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE {schema}.workflows ADD COLUMN timeout double precision;
ALTER TABLE {schema}.workflows ADD COLUMN deadline_at timestamptz;

CREATE INDEX workflows_running_by_queue ON {schema}.workflows (queue) WHERE status = 'running';
