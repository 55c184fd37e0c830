-- Every claim writes a token of its own, and every write an execution makes is fenced by it. The
-- attempt number alone cannot fence: a claim does not wait for the disk, so a claim lost in a server
-- crash leaves the row as it was, and the next claim hands out the same attempt number again while
-- the lost claim's execution may still be running. A token is never handed out twice.
ALTER TABLE {schema}.workflows ADD COLUMN lease_token bigint;
