"""What the conformance tests share: unique names, and a workflow kind of a test's own to start and
claim (so the tests of a module, on one store, never claim each other's work)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio

from pgflow._core.engine import NO_PINGS, Claimed, Engine
from pgflow._core.engine.starts import NO_TIMING, NewWorkflows, Started, Timing

LEASE = 30.0  # seconds: a lease no test outlives, unless it means to


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass
class Kind:
    """A workflow name and queue no other test uses."""

    name: str = field(default_factory=lambda: unique("wf"))
    queue: str = field(default_factory=lambda: unique("q"))

    def new(self, *, priority: int = 0, delay: float = 0.0, max_attempts: int | None = None,
            timeout: float | None = None, parent: str | None = None, traceparent: str | None = None,
            when: Timing = NO_TIMING) -> NewWorkflows:
        return NewWorkflows(name=self.name, queue=self.queue, priority=priority, delay=delay,
                            max_attempts=max_attempts, timeout=timeout, parent=parent, traceparent=traceparent,
                            when=when)

    async def start(self, engine: Engine, id: str | None = None, inputs: bytes = b"in", **options: Any) -> str:
        """Start a workflow of this kind (a new id unless given); its id."""
        id = id or unique(self.name)
        started = await engine.starts.enqueue(id, inputs, self.new(**options), NO_PINGS)
        assert started.created, started
        return id

    async def starts(self, engine: Engine, count: int, **options: Any) -> list[str]:
        ids = [unique(self.name) for _ in range(count)]
        found = await engine.starts.enqueue_many(ids, [b"in"] * count, self.new(**options), NO_PINGS)
        assert all(s.created for s in found), found
        return ids

    async def enqueue(self, engine: Engine, id: str, inputs: bytes = b"in", **options: Any) -> Started:
        return await engine.starts.enqueue(id, inputs, self.new(**options), NO_PINGS)

    async def claim(self, engine: Engine, owner: str = "owner", limit: int = 10,
                    lease: float = LEASE) -> list[Claimed]:
        claimed, _ = await engine.claims.claim(owner, [self.queue], [self.name], limit, lease)
        return claimed

    async def claim_one(self, engine: Engine, owner: str = "owner", lease: float = LEASE) -> Claimed:
        [claimed] = await self.claim(engine, owner, 1, lease)
        return claimed

    async def run(self, engine: Engine, owner: str = "owner", lease: float = LEASE, **options: Any) -> Claimed:
        """Start one workflow and claim it: a running workflow held by ``owner``."""
        id = await self.start(engine, **options)
        claimed = await self.claim_one(engine, owner, lease)
        assert claimed.id == id
        return claimed

    async def claim_within(self, engine: Engine, owner: str = "owner", limit: int = 10, lease: float = LEASE,
                           timeout: float = 5.0) -> list[Claimed]:
        """Claim until something is claimed, within ``timeout`` seconds: for work an engine hands out
        again only after a claim has noticed a lease ran out (PostgreSQL's full claim, at most a
        second apart, queues it again and the next claim takes it)."""
        with anyio.fail_after(timeout):
            while not (claimed := await self.claim(engine, owner, limit, lease)):
                await anyio.sleep(0.05)
        return claimed

    async def suspect_within(self, engine: Engine, owner: str = "owner", lease: float = LEASE,
                             timeout: float = 5.0) -> Claimed:
        """Claim rounds (which must hand out no suspect) until one says suspects wait, within
        ``timeout`` seconds (what a worker waits for before it claims a suspect), then the suspect."""
        with anyio.fail_after(timeout):
            while True:
                found = await engine.claims.claim_round(owner, [self.queue], [self.name], 10, lease)
                assert found.claimed == [], "a suspect went to a plain claim"
                if found.suspects:
                    break
                await anyio.sleep(0.05)
        suspect = await engine.claims.claim_suspect(owner, [self.queue], [self.name], lease)
        assert suspect is not None
        return suspect
