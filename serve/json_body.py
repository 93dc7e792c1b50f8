"""Reading and parsing a request's JSON body without letting it stall the server.

- The body must arrive within `--body-timeout` seconds (else 408: a client trickling bytes holds a
  connection and a handler, not the event loop).
- Parsing runs in a worker thread (`off_loop`), so a 30 MB body never blocks the event loop; and a
  cheap byte count first refuses bodies with more JSON values than any valid request carries (one C
  call of json.loads on millions of values holds the GIL for a second).
- A body of LARGE_BODY_BYTES or more is parsed in a helper process (`BodyParser`): json.loads
  holds the GIL for its whole call even in a thread (33 ms for 30 MB on a CI core, longer on a
  GPU host's), and every stream this process feeds stalls with it.
- Nesting deeper than MAX_JSON_DEPTH, integers of thousands of digits and invalid UTF-8 are 400s
  (json.loads raises RecursionError and ValueError for those, which would otherwise be 500s).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
import multiprocessing
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable, TypeVar

from aiohttp import web

from serve.errors import APIError, bad_request

# No valid request nests deeper than chat_template_kwargs needs; JSON's own parser recurses.
MAX_JSON_DEPTH = 32
# Values that are not token ids or prompts: a generous allowance for every other field.
EXTRA_JSON_ITEMS = 65536
# From this size a body is parsed in the helper process: below it json.loads takes ~1 ms, less
# than the round trip to another process costs.
LARGE_BODY_BYTES = 1 << 20

T = TypeVar("T")
logger = logging.getLogger(__name__)

# glibc's malloc serves a large allocation with its own mmap (given back to the OS when freed) only
# while it is above M_MMAP_THRESHOLD, which glibc raises on its own to the largest block freed so far:
# after one 30 MB body, later ones come from the heap, which keeps them (RSS +180 MB that never comes
# back, measured). A fixed threshold keeps every large buffer an mmap.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


def give_large_buffers_back() -> None:
    """Fix glibc's mmap threshold (process-wide; a no-op on another libc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        if not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
            logger.info("mallopt(M_MMAP_THRESHOLD) refused")
    except (OSError, AttributeError):
        pass


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run CPU-bound request work (JSON parsing, chat templates, tokenizing) in the default thread
    pool, so other requests (and /health) keep being served meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


def max_json_items(max_prompts: int, max_model_len: int) -> int:
    """The most JSON values a valid request can hold: every prompt a full-context token-id list."""
    return max_prompts * (max_model_len + 1) + EXTRA_JSON_ITEMS


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    if request.content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, got '{request.content_type or 'none'}'")
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()  # aiohttp raises 413 past client_max_size (--max-request-bytes)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                       headers={"Connection": "close"}) from None


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


def parse_json_object(raw: bytes, max_items: int) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it. Runs in a worker thread."""
    items = raw.count(b",")
    if items > max_items:
        raise bad_request(f"request body holds about {items} JSON values, more than any valid request "
                          f"(at most {max_items} with this server's limits)")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {str(e)[:200]}") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise bad_request(f"request body has a value JSON parsing refuses: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    if (raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
            and _depth_exceeds(body, MAX_JSON_DEPTH)):
        raise bad_request(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return body


class BodyParser:
    """The app's body parser: `parse_json_object` in a worker thread, or for a body of
    LARGE_BODY_BYTES or more in a helper process (started at the first such body). Only the bytes
    go there, over a pipe, and the parsed object comes back pickled: unpickling holds this
    process's GIL a few ms where parsing held it for tens. (Not a ProcessPoolExecutor: its queue
    keeps the last pickled call alive, 30 MB of RSS after a 30 MB body.) A helper that died is
    replaced, and that body parsed here."""

    def __init__(self, max_items: int):
        self.max_items = max_items
        self.helper_parses = 0  # bodies the helper parsed
        self._lock = threading.Lock()  # one body in the helper at a time
        self._helper: tuple[multiprocessing.Process, Connection] | None = None

    async def parse(self, raw: bytes) -> dict[str, Any]:
        if len(raw) < LARGE_BODY_BYTES:
            return await off_loop(parse_json_object, raw, self.max_items)
        return await off_loop(self._in_helper, raw)

    def _in_helper(self, raw: bytes) -> dict[str, Any]:
        with self._lock:
            try:
                if self._helper is None:
                    self._helper = self._start_helper()
                conn = self._helper[1]
                conn.send_bytes(raw)
                ok, value = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                logger.warning("the body-parsing helper process died; starting another next time")
                self._close_helper()
                return parse_json_object(raw, self.max_items)
        self.helper_parses += 1
        if not ok:
            raise value
        return value

    def _start_helper(self) -> tuple[multiprocessing.Process, Connection]:
        ctx = multiprocessing.get_context("spawn")  # a fork would copy our threads' locks mid-use
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_helper_loop, args=(theirs, self.max_items), daemon=True,
                           name="jaxinfer-body-parser")
        proc.start()
        theirs.close()
        return proc, ours

    def _close_helper(self) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            proc, conn = helper
            conn.close()  # (its loop ends at EOF)
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()

    def close(self) -> None:
        with self._lock:
            self._close_helper()


def _helper_loop(conn: Connection, max_items: int) -> None:
    """The helper process: parse each body it is sent, answer (True, object) or (False, the
    APIError), until the server closes the pipe."""
    while True:
        try:
            raw = conn.recv_bytes()
        except EOFError:
            return
        try:
            answer = (True, parse_json_object(raw, max_items))
        except APIError as e:
            answer = (False, e)
        del raw
        conn.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
        del answer


BODY_PARSER: web.AppKey[BodyParser] = web.AppKey("body_parser")
