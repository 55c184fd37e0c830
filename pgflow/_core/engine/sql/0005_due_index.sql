-- When the next delayed workflow of a queue falls due: one index entry per queue, not a scan (the
-- claim asks after every claim that left slots free).
CREATE INDEX workflows_due ON {schema}.workflows (queue, due_at) WHERE status = 'queued';
