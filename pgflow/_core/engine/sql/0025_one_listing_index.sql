-- Every write of a workflow row adds an entry to each of its full indexes: a workflow is written three
-- times (its start, its claim and its end), and none of those updates can be HOT, since each changes
-- the status. The three filter indexes of the dashboard's list (0018) cost more than the rest of each
-- end and claim: draining 20,000 no-ops at concurrency 64, the server spent 105 us per workflow on the
-- end and 80 on the claim with them, 63-75 and 45-56 without. So the list reads only the index of
-- creation time, filtering its rows as it goes, at most a bounded number of entries per page (the list
-- already read two filters given together that way); the dashboard continues from where a page's read
-- stopped.
DROP INDEX IF EXISTS {schema}.workflows_status_created;
DROP INDEX IF EXISTS {schema}.workflows_name_created;
DROP INDEX IF EXISTS {schema}.workflows_queue_created;
