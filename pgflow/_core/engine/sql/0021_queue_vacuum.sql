-- The workflows table is a queue: every workflow's row is updated a few times (claimed, renewed,
-- ended) and each update leaves a dead version behind in the table and in the indexes whose columns
-- or predicates it changes. By default autovacuum waits for dead rows to reach 20% of the table, and
-- with a week of finished workflows kept that is hundreds of thousands of dead versions, all of
-- which a claim's index scan may have to step over. Vacuum it after 2% (and at least 1,000), without
-- the cost delay that spreads a vacuum of a big table over minutes. (When a long transaction holds
-- the horizon back no vacuum helps; the claim is bounded for that: see engine/claims.py.)
ALTER TABLE {schema}.workflows SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000,
                                    autovacuum_vacuum_cost_delay = 0, autovacuum_analyze_scale_factor = 0.05);
