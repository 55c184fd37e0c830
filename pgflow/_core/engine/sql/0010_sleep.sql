-- Durable sleep: a journal entry that records when the workflow wakes (on the server's clock, so
-- every worker agrees on it). A workflow sleeping longer than the App's suspend_after goes back to the
-- queue with due_at at that time; the claim takes it again when it falls due.
ALTER TABLE {schema}.steps ADD COLUMN wake_at timestamptz;
