-- The scan behind 0022's constraint. VALIDATE CONSTRAINT takes SHARE UPDATE EXCLUSIVE, which lets
-- inserts, reads and deletes of chunks go on while it reads the table (seconds at ten million chunks).
ALTER TABLE {schema}.chunks VALIDATE CONSTRAINT chunk_ids_before_partitions;
