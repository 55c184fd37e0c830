-- Retention: the oldest finished workflows first, found without a scan.
CREATE INDEX workflows_finished ON {schema}.workflows (finished_at)
    WHERE status IN ('succeeded', 'failed', 'cancelled');
