-- Crash attribution. A worker that dies takes down every workflow it was running, and the one that
-- killed it cannot be told from the others by looking at the rows. So a workflow whose worker died
-- under it becomes a suspect: it is run again alone (a worker claims a suspect only when it runs
-- nothing else, and claims nothing beside it until that run ends), and only a crash of a run that was
-- alone is charged to it. Innocent neighbours of a crash lose no attempt; a workflow whose worker
-- died while running it alone is charged each time, and is given up after a few such crashes.
--
-- crashes: NULL for a workflow that is no suspect (every row, in the normal case); for a suspect,
-- the times its worker died while running it alone (0: it was only caught in another's crash).
ALTER TABLE {schema}.workflows ADD COLUMN crashes smallint;

-- The next claim of this workflow begins no new attempt (``pgflow.attempt()`` stays): set where a
-- run ends without having failed the workflow's budget (it gave its slot back to wait, its body is
-- retried under its retry policy, its worker died under it while it ran beside others). Kept on the
-- row until that claim, rather than moving attempt_base at once, so that the attempt shown between
-- two runs is the one the workflow had, not one less.
ALTER TABLE {schema}.workflows ADD COLUMN uncounted boolean NOT NULL DEFAULT false;

-- The suspects' own queue index, in the order of the queued one. Empty in the normal case: the
-- claims of a worker that runs nothing look here, and cost an empty index's probe; the queued
-- index's claims skip suspects with a check of the row they fetch anyway.
CREATE INDEX workflows_suspects ON {schema}.workflows (queue, priority DESC, due_at)
    WHERE status = 'queued' AND crashes IS NOT NULL;
