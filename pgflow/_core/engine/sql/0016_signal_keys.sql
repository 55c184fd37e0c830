-- The keyring that seals pings. PostgreSQL checks no privilege on LISTEN or NOTIFY, so any role that
-- can connect may hear and send on pgflow's channel; a payload is therefore sealed (authenticated and
-- encrypted) with a key kept here, where only the roles granted this table can read it. Rotation adds
-- a key that is sealed with from seal_from on, and gives the older ones an accept_until (see
-- Channel.rotate_signal_key): every process accepts both while the fleet moves over.
CREATE TABLE {schema}.signal_keys (
    id            integer PRIMARY KEY,
    -- 32 bytes from the server's strong random source (two version-4 UUIDs: 244 random bits).
    secret        bytea NOT NULL CHECK (octet_length(secret) = 32),
    created_at    timestamptz NOT NULL DEFAULT now(),
    seal_from     timestamptz NOT NULL DEFAULT now(),
    accept_until  timestamptz
);
REVOKE ALL ON {schema}.signal_keys FROM PUBLIC;

INSERT INTO {schema}.signal_keys (id, secret)
    VALUES (1, decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));

-- A journaled exception is data, never code: its type, message, arguments and traceback are in
-- steps.error. The pickled blobs older versions wrote are never read again; they are cleared so no
-- row keeps one.
UPDATE {schema}.steps SET exception = NULL WHERE exception IS NOT NULL;
