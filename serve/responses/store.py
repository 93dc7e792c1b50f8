"""Finished responses kept for `previous_response_id`, GET and DELETE: an in-memory LRU bounded by
`--responses-store-size` (the oldest is forgotten first; 0 keeps none). Each entry is the response
object and the conversation that continues it (its messages plus the assistant's output)."""

from __future__ import annotations

import argparse
import collections
import dataclasses

from aiohttp import web

from serve.errors import APIError

DEFAULT_STORE_SIZE = 1000


@dataclasses.dataclass
class StoredResponse:
    response: dict
    conversation: list[dict]  # chat messages, without the request's instructions


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[entry.response["id"]] = entry
        self._items.move_to_end(entry.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._items.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id[:200]}' not found.", param)
        self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)


RESPONSE_STORE: web.AppKey[ResponseStore] = web.AppKey("response_store")


def add_store_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE,
                   help="finished /v1/responses kept in memory for previous_response_id and GET (least "
                        "recently used forgotten first; 0: none) (default: %(default)s)")


def check_store_args(args: argparse.Namespace) -> None:
    if getattr(args, "responses_store_size", 0) < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
