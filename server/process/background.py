"""A server on its own event loop in a background thread, for tests, benchmarks and notebooks.

    with BackgroundServer(ServerConfig(model_dir=path, port=0)) as server:
        channel = grpc.insecure_channel(server.address)
        ...

The caller's thread stays free for blocking gRPC clients; `stop()` (or leaving
the `with` block) drains the server and joins the thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from echoic.server.config import ServerConfig
from echoic.server.process.app import Server, create_server

T = TypeVar("T")


async def _cancel_the_rest() -> None:
    """Cancel what still runs on the loop once the server has stopped, as asyncio.run does
    at its end (an HTTP connection still discarding the rest of a refused upload)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class BackgroundServer:
    def __init__(self, config: ServerConfig, *, start_timeout: float = 60.0) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="echoic-server", daemon=True
        )
        self._thread.start()
        try:
            self.server: Server
            self.server, self.port = self.run(create_server(config), timeout=start_timeout)
        except BaseException:
            self._close_loop()
            raise

    @property
    def address(self) -> str:
        """host:port to dial (the bound host, or 127.0.0.1 when bound to every interface)."""
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "[::]", "") else host
        return f"{host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return self.server.metrics_port

    @property
    def http_url(self) -> str:
        """http://host:port of the HTTP door (AssertionError when it is off)."""
        assert self.server.http_port is not None, "the server's HTTP door is off (http_port=0)"
        host, _ = self.address.rsplit(":", 1)
        return f"http://{host}:{self.server.http_port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 60.0) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float = 0.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.run(self.server.stop(grace), timeout=grace + 30.0)
            self.run(_cancel_the_rest(), timeout=30.0)
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
