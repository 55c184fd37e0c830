"""The PostgreSQL engine: every port pgflow's orchestration records through, over one pool and one schema.

The layers above say what is recorded (a start, a claim, a step's end, a chunk); the ports below say
how, in SQL. The engine composes the ports rather than inheriting them, so each can be read, tested (the
conformance suite in tests/engine/) and replaced on its own. The ports know rows, not workflows: they
take and return bytes, strings and numbers, and leave encoding and the meaning of a step to the layers
above.
"""

from __future__ import annotations

from ..pool import Pool
from .channel import Channel
from .chunks import Chunks
from .claims import Claims
from .clock import Testing
from .dashboard import Dashboard
from .database import Database
from .debounces import Debounces
from .details import Details
from .ends import Ends
from .free_streams import FreeStreams
from .journal import Journal
from .key_limits import KeyLimits
from .management import Management
from .migrations import Schema
from .partitions import Partitions
from .pausing import Pausing
from .reruns import Reruns
from .starts import Starts
from .waits import Waits
from .workers import Workers
from .workflows import Workflows


class Engine:
    """Every port over one schema, using a pool of autocommit connections."""

    def __init__(self, pool: Pool, schema: str) -> None:
        self.db = db = Database(pool, schema)
        self.pool = pool
        self.schema = schema
        # the hot path: a workflow's start, claim, journal, chunks and end
        self.starts = Starts(db)
        self.claims = Claims(db)
        self.journal = Journal(db)
        self.chunks = Chunks(db)
        self.ends = Ends(db)
        self.waits = Waits(db)
        self.reruns = Reruns(db)
        self.debounces = Debounces(db)
        # the fleet and the signed channel
        self.workers = Workers(db)
        self.channel = Channel(db)
        # looking, managing, keeping the schema
        self.workflows = Workflows(db)
        self.details = Details(db)
        self.management = Management(db)
        self.pausing = Pausing(db)
        self.key_limits = KeyLimits(db)
        self.partitions = Partitions(db)
        self.migrations = Schema(db)
        self.dashboard = Dashboard(db)
        self.free_streams = FreeStreams(db)
        self.testing = Testing(db)
