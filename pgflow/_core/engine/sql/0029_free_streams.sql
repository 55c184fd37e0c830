-- Free-standing Durable Streams (pgflow streams serve): streams that belong to no workflow, addressed by
-- a URL path. A stream's row is its whole state (tail, closure, expiry, its fork's source and point):
-- every append locks it, so appends to one stream are serialised and its tail, producers and chunks
-- change together in one transaction. Chunks are not copied into forks: a fork reads its source's chunks
-- below its fork point, and a deleted source that forks still read is kept (``deleted``) until the last
-- of them goes.
CREATE TABLE {schema}.free_streams (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    path          text NOT NULL,
    content_type  text NOT NULL,
    tail          bigint NOT NULL DEFAULT 0,      -- the next position: bytes, or messages in JSON mode
    closed        boolean NOT NULL DEFAULT false,
    closed_by     text,                           -- producer, epoch and seq of the append that closed it
    ttl_seconds   bigint,                         -- sliding: the stream goes after this long untouched
    expires_at    timestamptz,                    -- absolute
    touched_at    timestamptz NOT NULL DEFAULT now(),
    stream_seq    text,                           -- the last Stream-Seq (scope: the stream)
    forked_from   bigint REFERENCES {schema}.free_streams (id),
    fork_offset   bigint,                         -- positions below it are the source's
    fork_anchor   bigint,                         -- Stream-Fork-Offset and -Sub-Offset as asked, for
    fork_sub      bigint,                         -- an idempotent PUT to compare with
    deleted       boolean NOT NULL DEFAULT false, -- deleted while forks read it: 410 to clients
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX free_streams_path ON {schema}.free_streams (path);
CREATE INDEX free_streams_forks ON {schema}.free_streams (forked_from) WHERE forked_from IS NOT NULL;
CREATE INDEX free_streams_expiring ON {schema}.free_streams (id) WHERE ttl_seconds IS NOT NULL OR expires_at IS NOT NULL;

-- One row per append (byte streams) or per message (JSON mode), keyed by where it ends, so a read from
-- any position is one index range (the first row clipped when the position falls inside it).
CREATE TABLE {schema}.free_chunks (
    stream_id  bigint NOT NULL REFERENCES {schema}.free_streams (id) ON DELETE CASCADE,
    end_pos    bigint NOT NULL,
    size       bigint NOT NULL,  -- in positions: bytes, or 1 message
    batch_end  bigint NOT NULL,  -- where the append it came in ends (a fork's sub-offset stays inside it)
    data       bytea NOT NULL,
    PRIMARY KEY (stream_id, end_pos)
);

-- Idempotent producers: the last accepted (epoch, seq) of each producer of a stream.
CREATE TABLE {schema}.free_producers (
    stream_id  bigint NOT NULL REFERENCES {schema}.free_streams (id) ON DELETE CASCADE,
    producer   text NOT NULL,
    epoch      bigint NOT NULL,
    seq        bigint NOT NULL,
    PRIMARY KEY (stream_id, producer)
);
