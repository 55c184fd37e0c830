-- Chunks move into a table partitioned by stream id (0024), so that retention drops a whole
-- partition instead of deleting chunks one by one. The chunks written so far become its first
-- partition, which may hold only the ids handed out before, all below 2^32. This constraint says so,
-- and it is added NOT VALID: adding it takes the table's lock for an instant and scans nothing.
-- 0023 validates it in a transaction of its own, beside the writers, and 0024 attaches the table
-- as a partition without the scan the constraint makes needless. Each migration is a transaction.
ALTER TABLE {schema}.chunks ADD CONSTRAINT chunk_ids_before_partitions CHECK (stream_id < 4294967296) NOT VALID;
