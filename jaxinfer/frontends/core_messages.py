"""What the engine-core process and the server process say to each other (vLLM V1's
EngineCoreRequest / EngineCoreOutput(s), vllm/v1/engine/__init__.py).

The hot direction is core -> server: one `CoreOutputs` per engine step, carrying only what is new
since the previous one (each choice's new token ids, their logprobs when asked, finish events).
It is msgspec MessagePack with `array_like` structs: the field names are not sent, and encoding
and decoding run in C (docs/engine_core.md has the measurement that chose it over pickle).

The other direction (requests, aborts, admin calls) is one message per request or call, not per
step: a pickled `Call` (SamplingParams, LoRARequest and the exceptions a call raises travel as
they are). Its reply rides on the next `CoreOutputs`, pickled as the `(ok, value)` of the call.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import msgspec


class ChoiceDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One choice's new tokens since its previous delta."""
    index: int
    token_ids: list[int]
    # One per new token when the request asked for logprobs; `top_ids` / `top_logprobs`: its
    # `logprobs` alternatives per token, row-major (the SampledLogprobs layout).
    logprobs: list[float] | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request's news from one step."""
    request_id: str
    outputs: list[ChoiceDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    weight_version: int = 0
    # Pickled list[TokenLogprob | None], on the request's first output only (complete by then).
    prompt_logprobs: bytes | None = None
    embedding: list[float] | None = None  # a pooling request's, once finished


class CoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one core-loop iteration has to say."""
    outputs: list[CoreOutput] = []
    # Requests the engine itself failed (already aborted there): (request_id, message).
    failed: list[tuple[str, str]] = []
    # Replies to calls: (call id, pickled (ok, value-or-exception)).
    replies: list[tuple[int, bytes]] = []
    num_waiting: int = 0  # the scheduler's waiting sequences after this iteration's adds
    engine_index: int = 0  # which core (data-parallel replica) sent it
    # Set on the last message of a core loop that died: the repr of what killed it.
    dead: str | None = None


@dataclasses.dataclass
class Call:
    """A method call on the core: `add_request`, `abort`, or an admin call (engine_core.py's
    `EngineCore` methods). `call_id` 0: no reply wanted."""
    call_id: int
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


OUTPUTS_ENCODER = msgspec.msgpack.Encoder()
OUTPUTS_DECODER = msgspec.msgpack.Decoder(CoreOutputs)


def encode_call(call: Call) -> bytes:
    return pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)


def decode_call(data: bytes) -> Call:
    return pickle.loads(data)


def encode_reply(ok: bool, value: Any) -> bytes:
    try:
        return pickle.dumps((ok, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an unpicklable result or exception: its repr still gets back
        return pickle.dumps((False, RuntimeError(f"{value!r} (unpicklable: {e!r})")))
