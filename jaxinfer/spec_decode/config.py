"""Speculative decoding settings: the flags, vLLM's `--speculative-config '{json}'`, validation.

    --speculative-method ngram --num-speculative-tokens 4 [--ngram-prompt-lookup-min/max N]
    --speculative-model DIR --num-speculative-tokens 4          (method draft_model implied)
    --speculative-config '{"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": 5}'
                                            (an EAGLE-3 head in vLLM's / SGLang's HF format)
    --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'
                                            (DeepSeek-V3's or Qwen3-Next's multi-token-prediction
                                             module, from the target's checkpoint; vLLM's
                                             "deepseek_mtp" and "qwen3_next_mtp" too)
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 4, "disable_by_batch_size": 16}'

The JSON takes vLLM's key names; a key given both ways must agree. `disable_by_batch_size` (flag
`--speculative-disable-by-batch-size`) is the policy: a step speculates only while at most that
many sequences run (docs/spec_decode.md gives the measured crossover behind the default).
`min_acceptance` (flag `--speculative-min-acceptance`; our key, vLLM has none) pauses speculation
while recent proposals are accepted less often than that (`spec_decode/gate.py`; 0: never).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxinfer.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# Other names of a method (vLLM's older spelling).
_ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}
# Running sequences above which steps stop speculating (docs/spec_decode.md: the crossover).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
# Acceptance rate under which speculation pauses: below it a verifying step (k + 1 positions per
# row, the proposer, no overlap) cannot pay for itself; k = 4 at 10% makes 1.11 tokens per step.
DEFAULT_MIN_ACCEPTANCE = 0.1
MAX_SPECULATIVE_TOKENS = 16
# vLLM's speculative_config keys -> our field names.
_JSON_KEYS = {"method": "method", "model": "model",
              "num_speculative_tokens": "num_speculative_tokens",
              "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
              "disable_by_batch_size": "disable_by_batch_size", "min_acceptance": "min_acceptance"}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str                      # "ngram" | "draft_model" | "eagle3" | "mtp"
    num_speculative_tokens: int      # K: most proposals verified per sequence and step
    model: str | None = None         # the draft model's / EAGLE-3 head's directory
    prompt_lookup_min: int = 1       # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE

    def __post_init__(self):
        def check(ok: bool, flag: str, value, why: str):
            if not ok:
                raise ConfigError(f"--{flag} {value!r}: {why}")

        check(self.method in METHODS, "speculative-method", self.method,
              f"choose from {', '.join(METHODS)}")
        check(isinstance(self.num_speculative_tokens, int)
              and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              "num-speculative-tokens", self.num_speculative_tokens,
              f"must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}")
        if self.method in ("draft_model", "eagle3"):
            check(bool(self.model), "speculative-model", self.model,
                  f"the {self.method} method needs a model directory")
        else:
            check(self.model is None, "speculative-model", self.model,
                  "a draft model is only used by the draft_model and eagle3 methods (mtp reads "
                  "the target's own checkpoint)")
        check(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
              "ngram-prompt-lookup-min", self.prompt_lookup_min, "must be an integer >= 1")
        check(isinstance(self.prompt_lookup_max, int)
              and self.prompt_lookup_max >= self.prompt_lookup_min, "ngram-prompt-lookup-max",
              self.prompt_lookup_max, f"must be an integer >= --ngram-prompt-lookup-min "
                                      f"({self.prompt_lookup_min})")
        check(isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 1,
              "speculative-disable-by-batch-size", self.disable_by_batch_size,
              "must be an integer >= 1")
        check(isinstance(self.min_acceptance, (int, float)) and 0 <= self.min_acceptance <= 1,
              "speculative-min-acceptance", self.min_acceptance, "must be a number from 0 to 1")


def _parse_json(text: str | dict) -> dict:
    if isinstance(text, dict):
        raw = text
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError("--speculative-config: must be a JSON object")
    unknown = sorted(set(raw) - set(_JSON_KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config: unsupported key(s) {', '.join(unknown)} "
                          f"(supported: {', '.join(_JSON_KEYS)})")
    fields = {_JSON_KEYS[k]: v for k, v in raw.items() if v is not None}
    if isinstance(fields.get("method"), str):
        fields["method"] = _ALIASES.get(fields["method"], fields["method"])
    return fields


def speculative_config(*, method: str | None, model: str | None, num_tokens: int | None,
                       lookup_min: int | None, lookup_max: int | None,
                       disable_by_batch_size: int | None,
                       config_json: str | dict | None,
                       min_acceptance: float | None = None) -> SpeculativeConfig | None:
    """The settings from the flags and the JSON (None: speculation off). Raises ConfigError naming
    the flag for anything inconsistent."""
    flags = {"method": method, "model": model, "num_speculative_tokens": num_tokens,
             "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max,
             "disable_by_batch_size": disable_by_batch_size, "min_acceptance": min_acceptance}
    fields = {k: v for k, v in flags.items() if v is not None}
    if config_json:
        for key, value in _parse_json(config_json).items():
            if key in fields and fields[key] != value:
                raise ConfigError(f"--speculative-config sets {key}={value!r} but a flag sets it to "
                                  f"{fields[key]!r}")
            fields[key] = value
    if fields.get("model") and "method" not in fields:
        fields["method"] = "draft_model"
    if "method" not in fields:
        if fields:
            raise ConfigError(f"speculative decoding flags given ({', '.join(sorted(fields))}) "
                              f"without --speculative-method or --speculative-model")
        return None
    if "num_speculative_tokens" not in fields:
        raise ConfigError("--num-speculative-tokens is required with speculative decoding")
    return SpeculativeConfig(**fields)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (docs/spec_decode.md)")
    g.add_argument("--speculative-method", default=None, choices=METHODS,
                   help="propose tokens by n-gram prompt lookup, with a draft model, with an "
                        "EAGLE-3 head (eagle3: --speculative-model is the head's directory) or "
                        "with the checkpoint's DeepSeek-V3 / Qwen3-Next MTP module (mtp)")
    g.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="draft model directory (same tokenizer as the target); implies "
                        "--speculative-method draft_model")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed and verified per sequence and step")
    g.add_argument("--ngram-prompt-lookup-min", type=int, default=None, metavar="N",
                   help="shortest n-gram matched (default 1)")
    g.add_argument("--ngram-prompt-lookup-max", type=int, default=None, metavar="N",
                   help="longest n-gram matched, tried first (default 4)")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                   help=f"speculate only while at most N sequences run (default "
                        f"{DEFAULT_DISABLE_BY_BATCH_SIZE})")
    g.add_argument("--speculative-min-acceptance", type=float, default=None, metavar="RATE",
                   help=f"pause speculating while recent proposals are accepted less often than "
                        f"RATE (default {DEFAULT_MIN_ACCEPTANCE}; 0: never pause)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form: {\"method\", \"model\", \"num_speculative_tokens\", "
                        "\"prompt_lookup_min\", \"prompt_lookup_max\", \"disable_by_batch_size\"} "
                        "(and our \"min_acceptance\")")
