"""`jaxinfer generate`: complete one prompt (streamed to stdout) or a file of prompts (batched)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxinfer.errors import JaxinferError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from jaxinfer.engine.args import EngineArgs

    p = sub.add_parser(
        "generate", help="complete a prompt, or a file of prompts, and print the text",
        description="Complete --prompt (streamed as it is generated) or every line of --prompts-file "
                    "(batched through the engine's continuous-batching scheduler).",
        epilog="example: jaxinfer generate --prompt 'def fibonacci(n):' --max-tokens 48")
    src = p.add_argument_group("prompts (one of)")
    src.add_argument("--prompt", help="text to complete")
    src.add_argument("--prompts-file", type=Path,
                     help="a file with one prompt per line, or a .jsonl file of {\"prompt\": ...} objects")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    smp.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy (default: %(default)s)")
    smp.add_argument("--top-p", type=float, default=1.0)
    smp.add_argument("--top-k", type=int, default=0, help="0 = off")
    smp.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if (args.prompt is None) == (args.prompts_file is None):
        raise JaxinferError("give exactly one of --prompt or --prompts-file")
    if args.prompt is not None:
        return [args.prompt]
    path = args.prompts_file
    if not path.is_file():
        raise JaxinferError(f"--prompts-file '{path}' does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            return [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise JaxinferError(f"--prompts-file '{path}': each line must be a JSON object with a "
                                f"'prompt' field ({e})") from None
    if not lines:
        raise JaxinferError(f"--prompts-file '{path}' has no prompts")
    return lines


def run(args: argparse.Namespace) -> int:
    from jaxinfer.engine.args import EngineArgs
    from jaxinfer.frontends.factory import create_engine
    from jaxinfer.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, stop=args.stop, seed=args.seed)
    engine = create_engine(EngineArgs.from_cli_args(args))
    rids = [f"cli-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        engine.add_request(rid, prompt, params)  # validates before anything runs
    stream = len(prompts) == 1
    texts = {rid: "" for rid in rids}
    generated = 0
    t0 = time.perf_counter()
    if stream:
        sys.stdout.write(prompts[0])
    while engine.has_unfinished_requests():
        for out in engine.step():
            for choice in out.outputs:
                generated += len(choice.new_token_ids)
                texts[out.request_id] += choice.new_text
                if stream:
                    sys.stdout.write(choice.new_text)
                    sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    if stream:
        sys.stdout.write("\n")
    else:
        for rid, prompt in zip(rids, prompts):
            print(json.dumps({"prompt": prompt, "text": texts[rid]}, ensure_ascii=False))
    print(f"[{len(prompts)} prompt(s), {generated} tokens in {elapsed:.2f} s "
          f"({generated / max(elapsed, 1e-9):.1f} tok/s)]", file=sys.stderr)
    return 0
