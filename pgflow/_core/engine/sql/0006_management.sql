-- Operations: listing by creation time, and resuming a finished workflow with a fresh attempt budget
-- (attempts are counted from attempt_base, which a resume moves to the attempt it resumes from).
ALTER TABLE {schema}.workflows ADD COLUMN attempt_base integer NOT NULL DEFAULT 0;
CREATE INDEX workflows_created ON {schema}.workflows (created_at);
