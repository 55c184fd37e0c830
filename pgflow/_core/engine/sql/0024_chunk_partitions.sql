-- Stream chunks partitioned by time, so that retention drops whole partitions instead of deleting
-- chunks row by row (the dead rows, the WAL and the vacuum a delete of millions of chunks costs).
--
-- The partition key is the stream id, not a time column: a stream id says when its stream began,
-- (hours since 1970) * 2^32 plus a sequence number, so every chunk of a stream lies in the partition
-- of the period its stream began in. A read or a write names its stream id and so reaches exactly
-- one partition, and the key (stream_id, position) stays the primary key: no column is added to a
-- chunk. A stream id stays below 2^53, the largest integer a browser's JSON keeps exact, until 2209.
--
-- A partition is dropped once no stream of its period is left (pruning deletes a stream's name in
-- stream_ids with its workflow) and its period has ended: see drop_chunk_partitions. The chunks of a
-- pruned stream are unreachable from then on (every read goes through the stream's name) and go
-- with their partition.

-- How long a partition's period is, and how many periods ahead the maintenance service keeps
-- partitions ready. A change applies to the partitions made from then on.
CREATE TABLE {schema}.chunk_partitioning (
    one           boolean PRIMARY KEY DEFAULT true CHECK (one),
    period_hours  integer NOT NULL DEFAULT 24 CHECK (period_hours BETWEEN 1 AND 24 * 31),
    ahead         integer NOT NULL DEFAULT 2 CHECK (ahead BETWEEN 1 AND 100),
    -- How long after its period ends a partition is kept at least: a stream id handed out by a
    -- statement that has not committed yet when its period ends still finds its partition.
    grace_hours   integer NOT NULL DEFAULT 1 CHECK (grace_hours BETWEEN 0 AND 24 * 31)
);
INSERT INTO {schema}.chunk_partitioning DEFAULT VALUES;

-- The partitions of chunks: stream ids from first_id up to end_id (exclusive), for the streams that
-- began from starts_at up to ends_at.
CREATE TABLE {schema}.chunk_partitions (
    name       text PRIMARY KEY,
    first_id   bigint NOT NULL UNIQUE,
    end_id     bigint NOT NULL,
    starts_at  timestamptz NOT NULL,
    ends_at    timestamptz NOT NULL
);

-- The low 32 bits of a stream id.
CREATE SEQUENCE {schema}.stream_numbers AS bigint;

-- The first id of the partition new streams go to: that of the period the schema's clock is in;
-- when the maintenance service has not made that one (no worker ran for days), the latest partition
-- there is; a clock set before every partition gets the earliest. The streams from before 0024 (ids
-- below 2^32) keep the first partition, which no new stream joins.
CREATE FUNCTION {schema}.stream_partition() RETURNS bigint LANGUAGE plpgsql STABLE AS $$
DECLARE
    base bigint;
BEGIN
    SELECT first_id INTO base FROM {schema}.chunk_partitions
        WHERE first_id >= 4294967296 AND starts_at <= {schema}.clock_now()
        ORDER BY first_id DESC LIMIT 1;
    IF base IS NULL THEN
        SELECT min(first_id) INTO base FROM {schema}.chunk_partitions WHERE first_id >= 4294967296;
    END IF;
    IF base IS NULL THEN
        RAISE EXCEPTION 'pgflow: the chunks table of schema % has no partition to write to', '{schema}'
            USING HINT = 'Run pgflow migrate, or call ' || '{schema}' || '.add_chunk_partitions().';
    END IF;
    RETURN base;
END $$;

-- A new stream's id: its partition's first id and the next stream number.
CREATE FUNCTION {schema}.next_stream_id() RETURNS bigint LANGUAGE sql VOLATILE AS $$
    SELECT {schema}.stream_partition() | (nextval('{schema}.stream_numbers') & 4294967295)
$$;

-- Make the partitions of the current period and of `ahead` periods after it that are missing, and
-- return how many were made. Each is made as a table of its own and then attached: ATTACH takes
-- SHARE UPDATE EXCLUSIVE on chunks, which lets chunk writes and reads go on (CREATE TABLE ...
-- PARTITION OF would take ACCESS EXCLUSIVE), and its CHECK spares ATTACH the scan (of an empty table).
-- A period the fleet was down for gets no partition: no stream began in it.
CREATE FUNCTION {schema}.add_chunk_partitions() RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    origin CONSTANT timestamptz := timestamptz '2000-01-01 00:00:00+00';
    setting record;
    period interval;
    current_start timestamptz;
    next_start timestamptz;
    next_end timestamptz;
    first bigint;
    stop bigint;
    part text;
    made integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('pgflow.chunk_partitions.' || '{schema}'));
    SELECT * INTO setting FROM {schema}.chunk_partitioning;
    period := make_interval(hours => setting.period_hours);
    current_start := date_bin(period, {schema}.clock_now(), origin);
    SELECT greatest(current_start, max(ends_at)) INTO next_start
        FROM {schema}.chunk_partitions WHERE first_id >= 4294967296;
    next_start := coalesce(next_start, current_start);
    WHILE next_start < current_start + period * (setting.ahead + 1) LOOP
        next_end := date_bin(period, next_start, origin) + period;
        first := (extract(epoch FROM next_start)::bigint / 3600) << 32;
        stop := (extract(epoch FROM next_end)::bigint / 3600) << 32;
        part := 'chunks_' || to_char(next_start AT TIME ZONE 'UTC', 'YYYYMMDD_HH24');
        EXECUTE format('CREATE TABLE {schema}.%I (stream_id bigint NOT NULL, position integer NOT NULL,'
                       ' value bytea, PRIMARY KEY (stream_id, position),'
                       ' CONSTRAINT %I CHECK (stream_id >= %s AND stream_id < %s))',
                       part, part || '_ids', first, stop);
        EXECUTE format('ALTER TABLE {schema}.chunks ATTACH PARTITION {schema}.%I FOR VALUES FROM (%s) TO (%s)',
                       part, first, stop);
        -- The partition's bound checks what the constraint did, for every row routed to it.
        EXECUTE format('ALTER TABLE {schema}.%I DROP CONSTRAINT %I', part, part || '_ids');
        INSERT INTO {schema}.chunk_partitions VALUES (part, first, stop, next_start, next_end);
        next_start := next_end;
        made := made + 1;
    END LOOP;
    RETURN made;
END $$;

-- Drop the partitions no stream is left in whose period ended `grace_hours` ago and which no new
-- stream goes to, and return their names. The drop takes ACCESS EXCLUSIVE on chunks for an instant,
-- so it is taken only when there is something to drop, and the caller sets a lock_timeout: a drop
-- that cannot have the lock soon is tried again later rather than queue the writers behind it.
CREATE FUNCTION {schema}.droppable_chunk_partitions() RETURNS SETOF text LANGUAGE sql STABLE AS $$
    SELECT p.name FROM {schema}.chunk_partitions p, {schema}.chunk_partitioning s
    WHERE p.ends_at <= {schema}.clock_now() - make_interval(hours => s.grace_hours)
      AND p.first_id <> {schema}.stream_partition()
      AND NOT EXISTS (SELECT FROM {schema}.stream_ids i WHERE i.id >= p.first_id AND i.id < p.end_id)
    ORDER BY p.first_id
$$;

CREATE FUNCTION {schema}.drop_chunk_partitions() RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE
    doomed text;
BEGIN
    IF NOT EXISTS (SELECT FROM {schema}.droppable_chunk_partitions()) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('pgflow.chunk_partitions.' || '{schema}'));
    -- The parent first, then the partitions: the order every read and write takes them in. Under
    -- the lock no chunk is written, and new streams begin only in the partition no drop takes.
    LOCK TABLE {schema}.chunks IN ACCESS EXCLUSIVE MODE;
    FOR doomed IN SELECT * FROM {schema}.droppable_chunk_partitions() LOOP
        EXECUTE format('DROP TABLE {schema}.%I', doomed);
        DELETE FROM {schema}.chunk_partitions WHERE name = doomed;
        RETURN NEXT doomed;
    END LOOP;
END $$;

-- The table of chunks so far becomes the first partition, of the ids below 2^32: 0023 proved they
-- all are, so ATTACH scans nothing and writers wait only for these catalog changes.
LOCK TABLE {schema}.stream_ids, {schema}.chunks IN ACCESS EXCLUSIVE MODE;
ALTER TABLE {schema}.chunks RENAME TO chunks_before_partitions;
ALTER INDEX {schema}.chunks_pkey RENAME TO chunks_before_partitions_pkey;
CREATE TABLE {schema}.chunks (
    stream_id  bigint NOT NULL,
    position   integer NOT NULL,
    value      bytea,
    PRIMARY KEY (stream_id, position)
) PARTITION BY RANGE (stream_id);
ALTER TABLE {schema}.chunks ATTACH PARTITION {schema}.chunks_before_partitions
    FOR VALUES FROM (MINVALUE) TO (4294967296);
ALTER TABLE {schema}.chunks_before_partitions DROP CONSTRAINT chunk_ids_before_partitions;
INSERT INTO {schema}.chunk_partitions
    VALUES ('chunks_before_partitions', -9223372036854775808, 4294967296, 'epoch', {schema}.clock_now());

-- Whoever was granted the chunks keeps the grant.
DO $$
DECLARE
    granted record;
BEGIN
    FOR granted IN
        SELECT a.privilege_type, CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS who
        FROM pg_class c, aclexplode(c.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE c.oid = '{schema}.chunks_before_partitions'::regclass AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON {schema}.chunks TO %s', granted.privilege_type, granted.who);
    END LOOP;
END $$;

SELECT {schema}.add_chunk_partitions();
ALTER TABLE {schema}.stream_ids ALTER COLUMN id DROP IDENTITY,
    ALTER COLUMN id SET DEFAULT {schema}.next_stream_id();

-- The view of 0015 read the table that is now the first partition; it reads them all again.
CREATE OR REPLACE VIEW {schema}.streams AS
    SELECT i.workflow_id, i.key, c.position, c.value
    FROM {schema}.stream_ids i JOIN {schema}.chunks c ON c.stream_id = i.id;
