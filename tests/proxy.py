"""A TCP proxy on 127.0.0.1 that the fault tests put between pgflow and PostgreSQL, to break links the
way networks do: ``freeze()`` stops forwarding on the links open now, with neither RST nor FIN, while
new links still pass (a NAT entry lost, a path black-holed); ``reset()`` ends every open link with an
RST. It runs on an event loop in a thread of its own, so it forwards whatever the test's loop does."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg.conninfo

T = TypeVar("T")


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    frozen: bool = False
    pumps: list[asyncio.Task[None]] = field(default_factory=list)


class Proxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)  # a host starting with / is a socket directory
        self._links: list[_Link] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-proxy", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]
        self.accepted = 0

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def dsn(self, dsn: str) -> str:
        """``dsn`` pointed at this proxy."""
        return psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=self.port)

    def freeze(self) -> int:
        """Stop forwarding on every link open now; returns how many."""
        async def freeze() -> int:
            live = [link for link in self._links if not link.frozen and not link.client.is_closing()]
            for link in live:
                link.frozen = True
            return len(live)
        return self._call(freeze())

    def reset(self) -> int:
        """End every open link with an RST to both ends; returns how many."""
        async def reset() -> int:
            links, self._links = self._links, []
            for link in links:
                for writer in (link.client, link.server):
                    sock = writer.get_extra_info("socket")
                    if sock is not None and sock.family != socket.AF_UNIX:
                        with contextlib.suppress(OSError):  # closed already
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                for pump in link.pumps:
                    pump.cancel()
            await asyncio.gather(*(pump for link in links for pump in link.pumps), return_exceptions=True)
            return len(links)
        return self._call(reset())

    def close(self) -> None:
        self.reset()

        async def close() -> None:
            self._server.close()
            await self._server.wait_closed()
        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _accept(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            host, port = self._target
            if host.startswith("/"):
                server_in, server_out = await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
            else:
                server_in, server_out = await asyncio.open_connection(host, port)
        except OSError:
            client_out.transport.abort()
            return
        link = _Link(client_out, server_out)
        self._links.append(link)
        link.pumps = [asyncio.create_task(self._pump(link, client_in, server_out)),
                      asyncio.create_task(self._pump(link, server_in, client_out))]

    async def _pump(self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                if link.frozen:
                    await asyncio.Event().wait()  # hold it for ever: nothing goes through, nothing closes
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if not link.frozen:
                sink.transport.abort()


@contextmanager
def proxy_to(dsn: str) -> Iterator[Proxy]:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    proxy = Proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    try:
        yield proxy
    finally:
        proxy.close()
