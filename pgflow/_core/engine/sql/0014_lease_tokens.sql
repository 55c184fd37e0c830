-- Every claim writes a token of its own, and every write an execution makes is fenced by it. The
-- attempt number alone cannot fence: a claim does not wait for the disk, so a claim lost in a server
-- crash leaves the row as it was, and the next claim hands out the same attempt number again while
-- the lost claim's execution may still be running. A token is never handed out twice.
ALTER TABLE {schema}.workflows ADD COLUMN lease_token bigint;

-- Workers of the version before this one claim without a token. A claim of theirs must still fence
-- out the execution that held the row before (whose token the row would otherwise keep): a claim
-- that leaves the token as it was clears it.
CREATE FUNCTION {schema}.claim_without_token() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.lease_token := NULL;
    RETURN NEW;
END $$;
CREATE TRIGGER claim_without_token BEFORE UPDATE OF attempt ON {schema}.workflows FOR EACH ROW
    WHEN (NEW.attempt IS DISTINCT FROM OLD.attempt AND NEW.lease_token IS NOT DISTINCT FROM OLD.lease_token)
    EXECUTE FUNCTION {schema}.claim_without_token();
