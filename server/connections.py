"""A bound on the open connections of an aiohttp server: the HTTP door's port and the
metrics port.

Each open connection costs a file descriptor, and descriptors are shared by every door
of the process: 1,100 idle connections to the HTTP port once used up a 1,024-descriptor
limit and made the gRPC port unreachable too. aiohttp closes a connection that has no
request in progress after its keep-alive timeout, but accepts any number of them
meanwhile. `capped_server` and `CappedAppRunner` add the cap: one connection past `limit`
closes the oldest connection that has no request being answered (idle between requests,
or still sending its headers), and only when every other one is busy the newest itself.
A connection is busy while its request's handler runs: an upload being read, a
transcription, a realtime WebSocket for its whole life. A response that aiohttp writes
after its handler has returned is already in the connection's buffer, and a close
flushes that buffer first: the cap may end such a connection, but its client still
gets the whole response.

aiohttp is imported when a server is made (it is the serve extra's).
"""

from __future__ import annotations

import resource
from typing import Any

UNLIMITED = 1 << 20  # descriptors counted for a process whose limit is infinite (or huge)


def descriptor_share(fraction: float = 0.5) -> int:
    """`fraction` of this process's open-file limit (its soft RLIMIT_NOFILE): the default
    cap of a port's connections, so that one port's sockets leave the rest for the other
    ports, the model files and the pipes."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:  # no limit: a generous one
        soft = UNLIMITED
    return max(1, int(min(soft, UNLIMITED) * fraction))


def capped_server(handler: Any, *, limit: int, **kwargs: Any) -> Any:
    """aiohttp's low-level `web.Server` for `handler` (keyword arguments as its own), with
    at most `limit` open connections."""
    return _capped_class()(handler, limit=limit, **kwargs)


def _capped_class() -> type:
    from aiohttp import web

    class CappedServer(web.Server):
        def __init__(self, handler: Any, *, limit: int, **kwargs: Any) -> None:
            super().__init__(self._marking(handler), **kwargs)
            self.limit = limit
            self.busy: set[Any] = set()  # connections whose request is being answered
            # Open connections, oldest first; aiohttp's own list keeps one closed until its
            # handler task ends, so a connection chosen to close would be chosen again.
            self._open: dict[Any, None] = {}

        def _marking(self, handler: Any) -> Any:
            async def handle(request: Any) -> Any:
                self.busy.add(request.protocol)
                try:
                    return await handler(request)
                finally:
                    self.busy.discard(request.protocol)

            return handle

        def connection_made(self, handler: Any, transport: Any) -> None:
            super().connection_made(handler, transport)
            self._open[handler] = None
            if len(self._open) > self.limit:
                victim = next((h for h in self._open if h not in self.busy), handler)
                del self._open[victim]
                # after this call returns: the newest connection's handler is still starting
                self._loop.call_soon(victim.force_close)

        def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
            self._open.pop(handler, None)
            super().connection_lost(handler, exc)

    return CappedServer


def capped_app_runner(app: Any, *, limit: int, **kwargs: Any) -> Any:
    """`web.AppRunner(app, **kwargs)` whose server keeps at most `limit` connections open."""
    from aiohttp import web

    class CappedAppRunner(web.AppRunner):
        async def _make_server(self) -> web.Server:
            # The application's own server (started, frozen, with its request factory and
            # handler arguments), rebuilt with the cap around the same parts.
            plain = await super()._make_server()
            return capped_server(
                plain.request_handler, limit=limit, request_factory=plain.request_factory,
                handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                **plain._kwargs,
            )  # fmt: skip

    return CappedAppRunner(app, **kwargs)
