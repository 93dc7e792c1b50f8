"""Reading and parsing a request's JSON body without letting it stall the server.

- The body must arrive within `--body-timeout` seconds (else 408: a client trickling bytes holds a
  connection and a handler, not the event loop).
- Parsing runs in a worker thread (`off_loop`), so a 30 MB body never blocks the event loop; and a
  cheap byte count first refuses bodies with more JSON values than any valid request carries (one C
  call of json.loads on millions of values holds the GIL for a second).
- Nesting deeper than MAX_JSON_DEPTH, integers of thousands of digits and invalid UTF-8 are 400s
  (json.loads raises RecursionError and ValueError for those, which would otherwise be 500s).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import logging
from typing import Any, Callable, TypeVar

from aiohttp import web

from serve.errors import APIError, bad_request

# No valid request nests deeper than chat_template_kwargs needs; JSON's own parser recurses.
MAX_JSON_DEPTH = 32
# Values that are not token ids or prompts: a generous allowance for every other field.
EXTRA_JSON_ITEMS = 65536

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
