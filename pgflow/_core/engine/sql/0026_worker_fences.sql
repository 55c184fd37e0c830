-- A fence per worker, for the writes that would otherwise look up every workflow they write for: a
-- batch of stream chunks holds one row lock here instead of one per workflow of the batch (256
-- lookups by primary key in a batch of 256 streams: 40% of the statement).
--
-- A worker's chunks are written only while its row holds the epoch its executions were claimed
-- under (read by the claim). The epoch moves on, and the worker's batches under the old one are
-- refused, whenever one of its workflows is taken over while it runs: the trigger below fires on the
-- takeover of a running row, by any version's claim, in the claiming transaction, and its update waits
-- for the batches that hold the row. The other way a workflow changes hands under a running execution
-- is a claim lost in a crash (claims do not wait for the disk) or a failover: the table is UNLOGGED,
-- so after either it is empty, and every execution claimed before it finds no fence. A batch refused
-- here is written again under the workflows' own rows (fencing.held), which decide alone.
CREATE UNLOGGED TABLE {schema}.worker_fences (
    worker  text PRIMARY KEY,
    epoch   bigint NOT NULL
);

CREATE FUNCTION {schema}.fence_off_previous_owner() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {schema}.worker_fences SET epoch = epoch + 1 WHERE worker = OLD.lease_owner;
    RETURN NULL;
END $$;
CREATE TRIGGER fence_off_previous_owner AFTER UPDATE ON {schema}.workflows FOR EACH ROW
    WHEN (OLD.status = 'running' AND OLD.lease_owner IS NOT NULL
          AND NEW.lease_token IS DISTINCT FROM OLD.lease_token)
    EXECUTE FUNCTION {schema}.fence_off_previous_owner();

-- Whoever was granted the workers table is granted this one.
DO $$
DECLARE
    granted record;
BEGIN
    FOR granted IN
        SELECT a.privilege_type, CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS who
        FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE c.oid = '{schema}.workers'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON {schema}.worker_fences TO %s', granted.privilege_type, granted.who);
    END LOOP;
END $$;
