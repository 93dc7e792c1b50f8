"""Reasoning output apart from the answer: `--reasoning-parser` (parsers.py) over a marker-driven
streaming splitter (splitter.py); chat and the Responses API read it through `ReasoningRequest`
(request.py)."""
