-- expires_at: a workflow not started by then ends cancelled, without running (with_options(expires=)).
-- retries: how many times the body failed and was run again under its workflow's retry policy.
ALTER TABLE {schema}.workflows ADD COLUMN expires_at timestamptz;
ALTER TABLE {schema}.workflows ADD COLUMN retries integer NOT NULL DEFAULT 0;
