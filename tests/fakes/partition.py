"""A TCP proxy a test can cut: the network between one process and its server (a manager and its
PostgreSQL) partitioned, and healed again.

`cut()` stops moving bytes, both ways, without closing anything: the connections stay open, what
either end sends waits (in the proxy and the sockets' buffers), and a new connection is accepted
but gets no further. That is a partition that drops packets, as both ends see it: nobody is told,
calls just hang (TCP would retry for many minutes). `heal()` lets the waiting bytes through, in
order, and what happened meanwhile (an end that closed) reaches the other end after them.
"""

from __future__ import annotations

import asyncio
import contextlib

from sqlalchemy.engine import make_url


class Partition:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.listen_port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.connections = 0  # accepted so far

    @classmethod
    def to(cls, database_url: str) -> Partition:
        """A proxy to the server of a SQLAlchemy database URL."""
        u = make_url(database_url)
        return cls(u.host or "127.0.0.1", u.port or 5432)

    def url(self, database_url: str) -> str:
        """`database_url` through this proxy."""
        return make_url(database_url).set(host="127.0.0.1", port=self.listen_port).render_as_string(
            hide_password=False)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        self._open.clear()

    def heal(self) -> None:
        self._open.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        await self._open.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self._writers.append(up_writer)
        for r, w in ((reader, up_writer), (up_reader, writer)):
            t = asyncio.ensure_future(self._pump(r, w))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await r.read(65536)
                await self._open.wait()  # bytes read just before a cut wait here
                if not data:
                    break
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for w in self._writers:
            with contextlib.suppress(Exception):
                w.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
