"""serve/connections.py's protocol on a bare aiohttp app (no engine): a request head that times
out closes its connection without an error in the event loop; malformed HTTP is one rate-limited
WARNING line, not an ERROR with a traceback; a client that half-closes after its request
(`shutdown(SHUT_WR)`, `nc -N`) gets its reply (issue 38)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from serve.connections import GuardedTCPSite


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    await asyncio.sleep(0.2)  # (a reply takes a while: the client's EOF arrives before it)
    return web.Response(text=f"got {len(body)} bytes")


async def with_server(client, header_timeout: float = 5.0, routes=()):
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    app = web.Application()
    app.router.add_post("/", echo)
    for path, handler in routes:
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, header_timeout=header_timeout)
    await site.start()
    try:
        return await client(site._bound_port), errors
    finally:
        await runner.cleanup()


async def exchange(port: int, data: bytes, half_close: bool = False, wait_s: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    if half_close:
        writer.write_eof()
    await asyncio.sleep(wait_s)
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return reply


def test_a_request_head_past_its_deadline_closes_without_a_loop_error():
    reply, errors = asyncio.run(with_server(
        lambda port: exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\n", wait_s=0.3),
        header_timeout=0.1))
    assert reply == b"" and errors == []


def test_a_half_closed_request_gets_its_reply():
    reply, _ = asyncio.run(with_server(lambda port: exchange(
        port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", half_close=True)))
    interim, _, final = reply.partition(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 102 Processing"  # (tells a client that left from one that waits)
    assert final.startswith(b"HTTP/1.1 200") and final.endswith(b"got 5 bytes")


def test_a_client_that_closed_its_socket_is_still_cancelled():
    """EOF alone cannot tell a half-close from a client that left: the 102 it is sent draws a
    reset from a closed socket, and the handler is cancelled within a poll or two."""
    cancelled = []
    entered = asyncio.Event()
    done = asyncio.Event()  # the handler ended, cancelled or not

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        finally:
            done.set()
        return web.Response(text="late")

    async def client(port: int) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await asyncio.wait_for(entered.wait(), 10)
        writer.close()  # gone: FIN, then a reset for whatever the server sends
        # Waits on the handler, not on a guess of the poll's pace: a loaded machine only waits
        # longer; a handler never cancelled runs its 30 s and is seen uncancelled.
        await asyncio.wait_for(done.wait(), 60)

    asyncio.run(with_server(client, routes=[("/slow", slow)]))
    assert cancelled == [True]


def test_malformed_http_is_one_warning_line(caplog):
    async def three(port):
        return [await exchange(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
                for _ in range(3)]

    with caplog.at_level(logging.DEBUG):
        replies, _ = asyncio.run(with_server(three))
    assert all(b" 400 Bad Request" in r.split(b"\r\n")[0] for r in replies), replies
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "malformed HTTP request" in warnings[0].getMessage()
