-- Workflows, their step journal, and stream chunks. {schema} is replaced by the quoted schema name.

CREATE TABLE {schema}.workflows (
    id                text PRIMARY KEY,
    name              text NOT NULL,
    queue             text NOT NULL,
    priority          integer NOT NULL DEFAULT 0,
    status            text NOT NULL DEFAULT 'queued'
                      CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    inputs            bytea NOT NULL,
    output            bytea,
    error             jsonb,
    -- Incremented by every claim; every write made on behalf of an execution carries it (fencing).
    attempt           integer NOT NULL DEFAULT 0,
    max_attempts      integer,
    due_at            timestamptz NOT NULL DEFAULT now(),
    lease_owner       text,
    lease_expires_at  timestamptz,
    cancel_requested  boolean NOT NULL DEFAULT false,
    created_at        timestamptz NOT NULL DEFAULT now(),
    started_at        timestamptz,
    finished_at       timestamptz
);

-- The claim reads queued rows in priority then due order, and running rows whose lease expired.
CREATE INDEX workflows_queued ON {schema}.workflows (queue, priority DESC, due_at) WHERE status = 'queued';
CREATE INDEX workflows_leased ON {schema}.workflows (lease_expires_at) WHERE status = 'running';

CREATE TABLE {schema}.steps (
    workflow_id  text NOT NULL REFERENCES {schema}.workflows (id) ON DELETE CASCADE,
    position     integer NOT NULL,
    name         text NOT NULL,
    output       bytea,
    error        jsonb,
    -- The pickled exception, so a replayed workflow sees the same exception type it saw the first time.
    exception    bytea,
    attempts     integer NOT NULL,
    attempt      integer NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (workflow_id, position)
);
