"""The OpenAI Batch file format. Input: one JSON object a line, {custom_id, method: "POST",
url: "/v1/completions" or "/v1/chat/completions", body}. Output: one line a request,
{id, custom_id, response: {status_code, request_id, body}, error}: `body` is exactly what the HTTP
endpoint answers (a completion, or an OpenAI-shaped error with its status code); `error` is set,
and `response` null, only for a line that is not a request at all (bad JSON, no custom_id, an
unknown url).

The input is read with grain: a random-access source over the file's line offsets, parsed by a
grain map in reader threads ahead of the engine."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

URLS = {"/v1/completions": False, "/v1/chat/completions": True}  # url -> chat


@dataclasses.dataclass
class BatchLine:
    line_number: int                  # 1-based, for messages
    custom_id: str | None
    chat: bool = False
    body: dict | None = None
    error: str | None = None          # the line is not a usable request


class JsonlLines:
    """grain's random-access source protocol (__len__, __getitem__) over a JSONL file's lines, by
    byte offset: the file is scanned once, never held in memory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offsets: list[int] = []
        with self.path.open("rb") as f:
            pos = 0
            for raw in f:
                if raw.strip():
                    self._offsets.append(pos)
                pos += len(raw)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        with self.path.open("rb") as f:  # (reader threads each open their own handle)
            f.seek(self._offsets[index])
            return index, f.readline()


def parse_line(item: tuple[int, bytes]) -> BatchLine:
    index, raw = item
    number = index + 1
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return BatchLine(number, None, error=f"line {number}: not valid JSON ({e})")
    if not isinstance(obj, dict):
        return BatchLine(number, None, error=f"line {number}: not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, error=f"line {number}: custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        return BatchLine(number, custom_id, error=f"line {number}: method must be POST")
    url = obj.get("url")
    if url not in URLS:
        return BatchLine(number, custom_id,
                         error=f"line {number}: url must be one of {sorted(URLS)}, got {str(url)[:80]!r}")
    if not isinstance(obj.get("body"), dict):
        return BatchLine(number, custom_id, error=f"line {number}: body must be a JSON object")
    return BatchLine(number, custom_id, URLS[url], obj["body"])


def read_lines(path: str | Path, reader_threads: int = 2) -> tuple[int, Iterator[BatchLine]]:
    """(number of lines, the parsed lines in file order)."""
    import grain

    source = JsonlLines(path)
    ds = grain.MapDataset.source(source).map(parse_line)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=reader_threads, prefetch_buffer_size=256))
    return len(source), iter(it)


def done_ids(path: str | Path) -> set[str]:
    """custom_ids already answered in an output file (a run resumed skips them). A last line cut
    short by a crash is dropped from the file, so that request runs again."""
    path = Path(path)
    if not path.exists():
        return set()
    ids: set[str] = set()
    keep = 0
    with path.open("rb") as f:
        for raw in f:
            try:
                cid = json.loads(raw).get("custom_id")
            except ValueError:
                break
            if not raw.endswith(b"\n"):
                break
            keep += len(raw)
            if isinstance(cid, str):
                ids.add(cid)
    if keep != path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(keep)
    return ids


def output_line(custom_id: str | None, status: int | None = None, body: dict | None = None,
                error: str | None = None) -> str:
    response = None if status is None else {"status_code": status, "request_id": uuid.uuid4().hex,
                                            "body": body}
    err: dict[str, Any] | None = None if error is None else {"code": "invalid_request", "message": error}
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
                       "error": err}) + "\n"
