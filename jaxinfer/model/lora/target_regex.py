"""`target_modules` given as a regex (PEFT's form: `re.fullmatch` over module paths), matched in a
child process under a time limit.

Python's `re` backtracks without bound on nested quantifiers (`(.+)+Z` over a 31-character module
path runs for minutes) and holds the GIL the whole time, so a pattern matched in the server's
process, even in a worker thread, would freeze the engine loop and /health alike. A child process
(`python -I -S`, nothing imported but `re` and `json`: tens of milliseconds to start) is killed at
the limit, and the adapter is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys

MATCH_TIMEOUT_S = 1.0
MAX_PATTERN_CHARS = 1000  # PEFT's regexes name a few layers and projections

_CHILD = """
import json, re, sys
query = json.load(sys.stdin)
try:
    pattern = re.compile(query["pattern"])
except (re.error, RecursionError, OverflowError, ValueError) as e:
    json.dump({"error": str(e)[:200]}, sys.stdout)
else:
    json.dump({"matched": [pattern.fullmatch(p) is not None for p in query["paths"]]}, sys.stdout)
"""


class TargetRegexError(ValueError):
    """A pattern that is not a valid regex, is too long, or does not finish matching in time."""


def fullmatches(pattern: str, paths: list[str], timeout_s: float = MATCH_TIMEOUT_S) -> list[bool]:
    """Whether `pattern` fully matches each of `paths` (re.fullmatch), decided in a child process
    killed after `timeout_s`. Raises TargetRegexError."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise TargetRegexError(f"the regex is {len(pattern)} characters long, over "
                               f"{MAX_PATTERN_CHARS}")
    query = json.dumps({"pattern": pattern, "paths": paths})  # lone surrogates travel escaped
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _CHILD], input=query,
                              capture_output=True, text=True, encoding="utf-8", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TargetRegexError(f"the regex did not finish matching the model's module paths "
                               f"within {timeout_s:g} s (nested quantifiers backtrack)") from None
    if done.returncode != 0:  # e.g. a pattern so large that compiling it ran out of memory
        raise TargetRegexError(f"matching the regex failed (exit status {done.returncode})")
    answer = json.loads(done.stdout)
    if "error" in answer:
        raise TargetRegexError(f"not a valid regex: {answer['error']}")
    return answer["matched"]
