"""Connection timeouts: slow or idle clients are closed, so they cannot hold the server's sockets.

- Idle keep-alive (`--keepalive-timeout`): aiohttp's own `keepalive_timeout`. aiohttp arms it when a
  connection opens and after each response, and closes the connection if no complete request head
  has arrived by then.
- Request head (`--header-timeout`): aiohttp 3.x has no timeout for reading a request's head once
  its first bytes arrived (a client sending one header line every 10 s kept its socket for an hour).
  `GuardedRequestHandler` adds one at the transport level: the first bytes of a head start a timer,
  the completed head stops it, and a head still incomplete when it fires closes the connection.
- Request body (`--body-timeout`): serve/json_body.py reads the body under a timeout (408).

Also: a client that half-closes after its request (`shutdown(SHUT_WR)`, `nc -N`) gets its reply
before the connection closes (asyncio closes a transport at EOF unless the protocol asks not to;
a client that closed its socket altogether is then noticed when its reply, or a stream's next
event, is written, which cancels the handler as before);
malformed HTTP (aiohttp answers 400) is logged as one WARNING line, at most one a second with a
count of those left out, instead of an ERROR with a traceback per request.

The handler reads two private fields of aiohttp's RequestHandler (`_waiter`: set while waiting for
the next request head; `_force_close`): tests/test_server_hard_edges.py checks the behaviour, so an
aiohttp upgrade that changes them fails there.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0


class _RateLimitedWarning:
    """One WARNING line per `interval_s` at most; the next line counts those left out."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._last = float("-inf")
        self._skipped = 0

    def __call__(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._skipped += 1
            return
        more = f" ({self._skipped} more since the last such line)" if self._skipped else ""
        self._last, self._skipped = now, 0
        logger.warning(message + more, *args)


_malformed_http = _RateLimitedWarning()


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
            self.force_close()  # (closes the transport and forgets it)

    def eof_received(self) -> bool | None:
        """The client half-closed. With a request received and not answered yet, keep the socket
        open for the reply and close after it (True: asyncio leaves the transport open); idle or
        part-way through a head, close now."""
        if self._messages or (self._waiter is None and self._request_count):
            self.close()
            return True
        return None

    def log_exception(self, *args, **kw) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):  # malformed HTTP, answered 400: not our error
            _malformed_http("malformed HTTP request from %s answered %d: %s",
                            args[1] if len(args) > 1 else "?", exc.code, exc.message)
            return
        super().log_exception(*args, **kw)

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
