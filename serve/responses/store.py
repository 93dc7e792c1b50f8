"""Finished responses kept for `previous_response_id`, GET and DELETE: an in-memory LRU bounded both
by `--responses-store-size` entries and by `--responses-store-mib` of memory (the least recently
used is forgotten first; 0 keeps none). Each entry is the response object and the conversation that
continues it (its messages plus the assistant's output); an entry larger than the whole byte bound
is not kept, so a later GET or `previous_response_id` for it is a 404 like any forgotten one."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import sys

from aiohttp import web

from serve.errors import APIError

logger = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1000
DEFAULT_STORE_MIB = 256.0
MIB = 1 << 20


@dataclasses.dataclass
class StoredResponse:
    response: dict
    conversation: list[dict]  # chat messages, without the request's instructions

    def footprint(self) -> int:
        """Its bytes in memory: one step per object it holds (a tool schema may hold a million),
        so servers measure it off the event loop."""
        return footprint(self.response, self.conversation)


def footprint(*roots) -> int:
    """Bytes of memory the objects reachable from `roots` hold (sys.getsizeof of every dict, list,
    string and number, each object once). Objects shared with another entry (a continued
    conversation's earlier turns) count in both: the store's total is an upper bound. Walks without
    recursion; costs one step per object, not per byte."""
    seen: set[int] = set()
    total = 0
    stack = list(roots)
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        total += sys.getsizeof(value)
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int = int(DEFAULT_STORE_MIB * MIB)):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0  # the entries' footprints, summed
        self._items: collections.OrderedDict[str, tuple[StoredResponse, int]] = collections.OrderedDict()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ResponseStore":
        return cls(getattr(args, "responses_store_size", DEFAULT_STORE_SIZE),
                   int(getattr(args, "responses_store_mib", DEFAULT_STORE_MIB) * MIB))

    def put(self, entry: StoredResponse, size: int) -> bool:
        """Keep `entry`, of `size` bytes (its footprint()), forgetting the least recently used ones
        it needs room from; False when it alone is larger than the byte bound, or the store keeps
        nothing."""
        if self.capacity <= 0:
            return False
        if size > self.max_bytes:
            logger.info("response %s not stored: %d bytes, more than --responses-store-mib (%d bytes)",
                        entry.response["id"], size, self.max_bytes)
            return False
        self._forget(entry.response["id"])
        while self._items and (len(self._items) >= self.capacity or self.nbytes + size > self.max_bytes):
            self._forget(next(iter(self._items)))
        self._items[entry.response["id"]] = (entry, size)
        self.nbytes += size
        return True

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"Response with id '{response_id[:200]}' not found.", param)
        self._items.move_to_end(response_id)
        return item[0]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self._forget(response_id)

    def _forget(self, response_id: str) -> None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.nbytes -= item[1]

    def __len__(self) -> int:
        return len(self._items)


RESPONSE_STORE: web.AppKey[ResponseStore] = web.AppKey("response_store")


def add_store_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE,
                   help="finished /v1/responses kept in memory for previous_response_id and GET (least "
                        "recently used forgotten first; 0: none) (default: %(default)s)")
    g.add_argument("--responses-store-mib", type=float, default=DEFAULT_STORE_MIB,
                   help="memory the kept /v1/responses may hold, in MiB (least recently used forgotten "
                        "first; a larger response is not kept) (default: %(default)s)")


def check_store_args(args: argparse.Namespace) -> None:
    if getattr(args, "responses_store_size", 0) < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if not 0 <= getattr(args, "responses_store_mib", 0) < float("inf"):
        raise ValueError(f"--responses-store-mib must be >= 0, got {args.responses_store_mib}")
