"""`jaxinfer generate`: complete a prompt from the command line (one sequence over the paged cache)."""

from __future__ import annotations

import argparse
import sys
import time

from jaxinfer.errors import JaxinferError
from jaxinfer.paths import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt and print the text",
                       description="Complete PROMPT with a model and stream the text to stdout.")
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="HF model directory (default: the bundled demo model)")
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "orbax", "dummy"],
                   help="weights to load; 'dummy' = random weights of the real shapes")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="weight and activation dtype (default: %(default)s)")
    p.add_argument("--attention-backend", default="auto",
                   help="auto | reference | mosaic | triton (default: auto)")
    p.add_argument("--block-size", type=int, default=16, choices=[16, 32], help="KV cache page size")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from jaxinfer.config import load_config
    from jaxinfer.kv_cache.device_cache import allocate_kv_cache
    from jaxinfer.model import forward
    from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer
    from jaxinfer.weights import load_params
    from pallas_kernels.backend import get_backend
    from pallas_kernels.metadata import AttentionMetadata

    if args.max_tokens < 1:
        raise JaxinferError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise JaxinferError(f"--temperature must be >= 0, got {args.temperature}")
    cfg = load_config(args.model)
    tok = Tokenizer.from_dir(args.model)
    params = load_params(args.model, cfg, getattr(jnp, args.dtype), args.load_format)
    backend = get_backend(args.attention_backend)
    prompt = tok.encode(args.prompt)
    if not prompt:
        raise JaxinferError("--prompt is empty after tokenization")
    total = len(prompt) + args.max_tokens
    if total > cfg.max_position_embeddings:
        raise JaxinferError(f"prompt ({len(prompt)} tokens) + --max-tokens ({args.max_tokens}) exceeds the "
                            f"model's context of {cfg.max_position_embeddings} tokens")
    bs = args.block_size
    num_blocks = -(-total // bs)
    table = jnp.arange(num_blocks, dtype=jnp.int32)[None]
    cache = allocate_kv_cache(cfg, num_blocks, bs, getattr(jnp, args.dtype))
    step = jax.jit(forward, static_argnames=("cfg", "backend"), donate_argnames=("kv_cache",))
    key = jax.random.key(args.seed)

    def pick(logits, i):
        if args.temperature == 0:
            return int(jnp.argmax(logits))
        return int(jax.random.categorical(jax.random.fold_in(key, i), logits / args.temperature))

    n = len(prompt)
    md = AttentionMetadata(jnp.arange(n, dtype=jnp.int32), jnp.array([0, n], jnp.int32),
                           jnp.array([n], jnp.int32), table)
    t0 = time.perf_counter()
    logits, cache = step(params, cfg, jnp.asarray(prompt, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                         cache, md, backend, jnp.array([n - 1]))
    detok = IncrementalDetokenizer(tok, prompt)
    sys.stdout.write(args.prompt)
    generated = []
    for i in range(args.max_tokens):
        token = pick(logits[0], i)
        generated.append(token)
        if token in tok.eos_token_ids:
            break
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
        pos = n + i
        if i + 1 == args.max_tokens:
            break
        md = AttentionMetadata(jnp.array([pos], jnp.int32), jnp.array([0, 1], jnp.int32),
                               jnp.array([pos + 1], jnp.int32), table, num_decodes=1)
        logits, cache = step(params, cfg, jnp.array([token], jnp.int32), jnp.array([pos], jnp.int32),
                             cache, md, backend)
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    print(f"[{len(generated)} tokens in {elapsed:.2f} s, {len(generated) / elapsed:.1f} tok/s, "
          f"backend={backend.name}, device={jax.devices()[0].platform}]", file=sys.stderr)
    return 0
