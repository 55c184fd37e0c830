"""What a transaction-mode pooler in front of pgflow must do in pgflow's stead.

Through such a pooler (``App(dsn=<pooler>, listen_dsn=<server>)``) pgflow's pool sends the server no
settings at connect time: each transaction may run on another server session, so a setting is kept
only when the pooler makes it on every session it opens (pgbouncer's ``connect_query``). pgflow looks
once, at the first connection, and warns of what is missing with the line that supplies it: the
catalog-only search path (no object another role creates can stand in for a built-in one in pgflow's
statements), no JIT (it costs more than it saves on pgflow's statements) and the idle-in-transaction
timeout (a paused worker cannot keep row locks past ``query_timeout``). pgflow works without them,
less safely and a little slower, so this warns rather than refuses.
"""

from __future__ import annotations

import logging

from .connecting import missing_settings, server_settings
from .engine import sessions
from .pool import Pool

log = logging.getLogger("pgflow")


async def warn_of_missing_settings(pool: Pool, query_timeout: float) -> list[str]:
    """Log a warning naming the settings the pooler's server sessions lack; returns their SETs."""
    async with pool.connection() as conn:
        found = await sessions.settings(conn, list(server_settings(query_timeout)))
    missing = missing_settings(found, query_timeout)
    if missing:
        log.warning("the server sessions behind the pooler at dsn= lack settings pgflow would make itself on a"
                    " direct connection; add them to the pooler's connect_query (pgbouncer: in the database's"
                    " entry, connect_query='%s') or as the role's defaults (ALTER ROLE ... SET), see"
                    " workers/README.md", "; ".join(missing))
    return missing
