"""Measure the bundled demo models on the CPU with jaxinfer's own loader and model code.

1. Held-out perplexity of target and draft on `--ppl-windows` windows spread evenly over the
   windows the training run evaluated on (build/demo_corpus/heldout.npy), as a check of the loaded
   bf16 weights against the training run's eval.
2. Draft agreement: the target greedy-decodes `--gen-tokens` tokens after each of `--prompts`
   held-out prompts; the draft's argmax on every prefix of that greedy sequence is compared with the
   target's token. Reported: the fraction of the target's greedy tokens the draft predicts, and the
   tokens per target step that greedy speculative decoding with k draft tokens would then make.
3. Golden continuations: greedy continuations of fixed prompts, committed to demo_golden.json for
   tests/test_demo_model.py, with the smallest top-1/top-2 logit gap along each (how far the
   golden path is from an argmax tie).
4. `--readme README.md` (or `--readme-only`): the README's first example -- the request and what
   the server returns for it -- rewritten from the target as served (jaxinfer's engine, the
   checkpoint's bf16 weights, greedy), between the `<!-- demo-example -->` markers.

    python -m checkpoints.measure_demo [--out checkpoints/demo_metrics.json] [--readme README.md]
    python -m checkpoints.measure_demo --readme-only      # README only (~30 s on a CPU)
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench.perplexity import make_logits_fn, perplexity
from jaxinfer.model.config import load_config
from jaxinfer.model.tokenizer import Tokenizer
from jaxinfer.model.weights import load_params

REPO = Path(__file__).resolve().parent.parent

TARGET_DIR = REPO / "checkpoints" / "demo-target"
DRAFT_DIR = REPO / "checkpoints" / "demo-draft"
# Prompts end without whitespace: the tokenizer merges a newline with the indentation after it, so
# a prompt ending in "\n" asks for a token split the model never saw in training.
GOLDEN_PROMPTS = ('class Stack:\n    """A last-in, first-out stack."""\n\n    def push(self, item):',
                  "import os\nimport sys\n\n\ndef main():")
GOLDEN_TOKENS = 24
SPEC_K = (1, 2, 3, 4, 5)
README_PROMPT, README_TOKENS = ('class Point:\n    """A point in the plane."""\n\n'
                                 "    def __init__(self, x, y):"), 48
README_BLOCK = re.compile(r"(<!-- demo-example[^>]*-->\n).*?(<!-- /demo-example -->)", re.S)


def load(model_dir: Path, dtype=jnp.float32):
    cfg = load_config(model_dir)
    return cfg, load_params(model_dir, cfg, dtype, progress=False)


def greedy(logits_fn, params, prompts: np.ndarray, n_new: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation of equal-length prompts with a dense forward per step (no cache). The
    sequence buffer has its final length from the start (one compiled shape); causal attention keeps
    the not-yet-written tail from affecting the positions read.
    Returns tokens [B, P + n_new] and the top-1 minus top-2 logit gap of each new token [B, n_new]."""
    b, plen = prompts.shape
    seq = np.zeros((b, plen + n_new), np.int32)
    seq[:, :plen] = prompts
    gaps = np.zeros((b, n_new), np.float32)
    for i in range(n_new):
        last = np.asarray(logits_fn(params, jnp.asarray(seq))[:, plen + i - 1])
        top2 = np.sort(last, axis=-1)[:, -2:]
        gaps[:, i] = top2[:, 1] - top2[:, 0]
        seq[:, plen + i] = last.argmax(-1)
    return seq, gaps


def speculative_tokens_per_step(match: np.ndarray, k: int) -> float:
    """Tokens per target step of greedy speculative decoding with k draft tokens, replayed along
    the target's greedy path: each step accepts the draft's leading matches, plus one token from
    the target (the correction or the bonus)."""
    steps, made = 0, 0
    for row in match:
        i = 0
        while i < len(row):
            accepted = 0
            while accepted < k and i + accepted < len(row) and row[i + accepted]:
                accepted += 1
            steps += 1
            made += min(accepted + 1, len(row) - i)
            i += accepted + 1
    return made / steps


def readme_example(target: Path, prompt: str = README_PROMPT) -> str:
    """The README's example as markdown: the curl request and the completion the engine returns
    (what `make serve` answers; the id and fields left out by the server's null-dropping as in
    the README)."""
    from jaxinfer import LLM, SamplingParams
    llm = LLM(model=str(target), warmup=False, compilation_cache_dir=None)
    out = llm.generate(prompt, SamplingParams(max_tokens=README_TOKENS, temperature=0.0),
                       use_tqdm=False)[0]
    text, n_prompt = out.outputs[0].text, len(out.prompt_token_ids)
    body = json.dumps({"model": "demo-target", "prompt": prompt, "max_tokens": README_TOKENS,
                       "temperature": 0})
    return (f"```bash\ncurl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
            f"  -d '{body}'\n```\n```json\n"
            '{"id": "cmpl-…", "object": "text_completion", "model": "demo-target",\n'
            ' "choices": [{"index": 0, "finish_reason": "length",\n'
            f'   "text": {json.dumps(text)}}}],\n'
            f' "usage": {{"prompt_tokens": {n_prompt}, "completion_tokens": {README_TOKENS}, '
            f'"total_tokens": {n_prompt + README_TOKENS}}}}}\n```\n'
            f"That text, as Python:\n```python\n{prompt}{text}\n```\n")


def refresh_readme(readme: Path, target: Path, prompt: str = README_PROMPT) -> None:
    old = readme.read_text()
    if not README_BLOCK.search(old):
        raise SystemExit(f"{readme}: no <!-- demo-example --> ... <!-- /demo-example --> block")
    example = readme_example(target, prompt)
    readme.write_text(README_BLOCK.sub(lambda m: m.group(1) + example + m.group(2), old, count=1))
    print(f"{readme}: example rewritten from {target}:\n{example}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=TARGET_DIR)
    p.add_argument("--draft", type=Path, default=DRAFT_DIR)
    p.add_argument("--data", type=Path, default=REPO / "build" / "demo_corpus")
    p.add_argument("--ppl-windows", type=int, default=16, help="held-out windows of seq_len for perplexity")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=REPO / "checkpoints" / "demo_metrics.json")
    p.add_argument("--golden-out", type=Path, default=REPO / "checkpoints" / "demo_golden.json")
    p.add_argument("--readme", type=Path, help="also rewrite this README's demo example")
    p.add_argument("--readme-only", action="store_true", help="only rewrite README.md's example")
    p.add_argument("--readme-prompt", default=README_PROMPT,
                   help="the example's prompt (end it without whitespace: see checkpoints/README.md)")
    args = p.parse_args(argv)
    if args.readme_only:
        refresh_readme(args.readme or REPO / "README.md", args.target, args.readme_prompt)
        return

    heldout = np.load(args.data / "heldout.npy").astype(np.int32)
    tok = Tokenizer.from_dir(args.target)
    models = {name: load(d) for name, d in (("target", args.target), ("draft", args.draft))}
    fns = {name: make_logits_fn(cfg) for name, (cfg, _) in models.items()}
    seq_len = models["target"][0].max_position_embeddings
    result: dict = {"backend": jax.default_backend(), "dtype": "float32 (bf16 weights upcast)"}

    train_log = json.loads((args.target / "training_log.json").read_text())
    eval_windows = min(train_log["hparams"]["eval_windows"], (heldout.size - 1) // seq_len)
    picked = np.linspace(0, eval_windows - 1, min(args.ppl_windows, eval_windows)).astype(int)
    windows = heldout[picked[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
    n = len(windows)
    for name, (cfg, params) in models.items():
        t0 = time.perf_counter()
        result[f"{name}_params"] = cfg.num_params()
        result[f"{name}_heldout_ppl"] = perplexity(fns[name], params, windows)
        print(f"{name}: {cfg.num_params():,} params, held-out ppl {result[f'{name}_heldout_ppl']:.3f} "
              f"over {windows.size - n:,} tokens ({time.perf_counter() - t0:.1f} s)", flush=True)
    result["ppl_tokens"] = int(windows.size - n)

    # Prompts spread evenly over the held-out stream, each at a document-internal offset.
    starts = np.linspace(0, heldout.size - args.prompt_tokens - 1, args.prompts).astype(int)
    prompts = np.stack([heldout[s:s + args.prompt_tokens] for s in starts])
    t0 = time.perf_counter()
    seq, _ = greedy(fns["target"], models["target"][1], prompts, args.gen_tokens)
    draft_logits = np.asarray(fns["draft"](models["draft"][1], jnp.asarray(seq[:, :-1])))
    draft_pred = draft_logits[:, args.prompt_tokens - 1:].argmax(-1)
    match = draft_pred == seq[:, args.prompt_tokens:]
    result["agreement"] = {
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "draft_predicts_target_greedy": float(match.mean()),
        "spec_tokens_per_target_step": {str(k): speculative_tokens_per_step(match, k) for k in SPEC_K},
    }
    print(f"draft predicts {match.mean():.1%} of the target's greedy tokens ({match.size} tokens, "
          f"{time.perf_counter() - t0:.1f} s); tokens per target step with k draft tokens: "
          f"{result['agreement']['spec_tokens_per_target_step']}", flush=True)

    golden = []
    # The README's prompt is always among them (tests/test_demo_model.py checks the README).
    for prompt in dict.fromkeys((*GOLDEN_PROMPTS, args.readme_prompt)):
        ids = tok.encode(prompt)
        entry = {"prompt": prompt, "prompt_ids": ids}
        for name, (_, params) in models.items():
            out, gaps = greedy(fns[name], params, np.asarray([ids]), GOLDEN_TOKENS)
            new = out[0, len(ids):].tolist()
            entry[name] = {"ids": new, "text": tok.decode(new), "min_logit_gap": float(gaps.min())}
            print(f"{name} | {prompt!r} -> {tok.decode(new)!r} (min gap {gaps.min():.3f})", flush=True)
        golden.append(entry)
    args.golden_out.write_text(json.dumps({"tokens": GOLDEN_TOKENS, "dtype": "float32", "cases": golden},
                                          indent=1) + "\n")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.readme is not None:
        refresh_readme(args.readme, args.target, args.readme_prompt)


if __name__ == "__main__":
    main()
