"""Connection timeouts: slow or idle clients are closed, so they cannot hold the server's sockets.

- Idle keep-alive (`--keepalive-timeout`): aiohttp's own `keepalive_timeout`. aiohttp arms it when a
  connection opens and after each response, and closes the connection if no complete request head
  has arrived by then.
- Request head (`--header-timeout`): aiohttp 3.x has no timeout for reading a request's head once
  its first bytes arrived (a client sending one header line every 10 s kept its socket for an hour).
  `GuardedRequestHandler` adds one at the transport level: the first bytes of a head start a timer,
  the completed head stops it, and a head still incomplete when it fires closes the connection.
- Request body (`--body-timeout`): serve/json_body.py reads the body under a timeout (408).

The handler reads two private fields of aiohttp's RequestHandler (`_waiter`: set while waiting for
the next request head; `_force_close`): tests/test_server_hard_edges.py checks the behaviour, so an
aiohttp upgrade that changes them fails there.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0


class GuardedRequestHandler(RequestHandler):
    """aiohttp's protocol, plus a deadline for each request head."""

    def __init__(self, manager, *, header_timeout: float, **kwargs):
        super().__init__(manager, **kwargs)
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def _waiting_for_head(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():  # part of a head arrived, the rest has not
            if self._head_timer is None and data:
                self._head_timer = self._loop.call_later(self._header_timeout, self._head_timed_out)
        elif self._head_timer is not None:  # the head is complete: the handler runs
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and self.transport is not None:
            logger.info("closing a connection whose request head took over %.1f s (--header-timeout)",
                        self._header_timeout)
            self.force_close()
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class GuardedTCPSite(web.TCPSite):
    """web.TCPSite whose connections are GuardedRequestHandlers with the runner's handler options."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, header_timeout: float):
        super().__init__(runner, host, port)
        self._header_timeout = header_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        header_timeout = self._header_timeout

        def protocol() -> GuardedRequestHandler:
            # What web.Server.__call__ makes, with the head deadline added.
            return GuardedRequestHandler(server, loop=loop, header_timeout=header_timeout,
                                         **server._kwargs)

        self._server = await loop.create_server(protocol, self._host, self._port,
                                                backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
