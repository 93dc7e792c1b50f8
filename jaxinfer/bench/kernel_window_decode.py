"""Sliding-window paged decode: the Mosaic decode kernel with a 1,024-token window over a 32k
context against the same kernel over a 1k context (what a window must cost: the window's pages,
not the context's).

    jaxinfer bench kernels --only window-decode [--save [DIR]]

First a correctness check at the real size (a few sequences of each timed case against the jnp
reference: the window, then the window with gpt-oss's sinks), then per-call times as
`kernel_decode.time_paged` measures them (chained calls inside one jit, queued, median): B64 x 32k
with window 1,024 (`decode_window1k_b64x32k_us`, including the XLA gather that cuts the block
tables to the window), the same with sinks (`decode_window1k_sinks_b64x32k_us`), the full 1k
context (`decode_full_b64x1k_us`, the goal: window / full <= 1.3) and the full 32k context for
scale (`decode_full_b64x32k_us`). Shape: kernel_decode's (Hq 32, Hkv 8, D 128, page 16, bf16).

The metrics go into the record families_<gpu>.json, which jaxinfer/bench/suites/families.py (the
model-level metrics) writes too: a saved record's other metrics are kept, these keys replaced.
BENCH_TINY_SHAPES=1: a CPU smoke run of the script with tiny shapes and the jnp reference as
the kernel.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.bench import results_io
from jaxinfer.bench.kernel_decode import HKV, HQ, D, PAGE, make_paged_case, time_paged, warm_up_gpu
from pallas_kernels.attention.paged_decode import paged_decode_mosaic
from pallas_kernels.attention.reference import paged_decode_reference

TINY = bool(os.environ.get("BENCH_TINY_SHAPES"))
BATCH, LONG, SHORT, WINDOW = (2, 2048, 1024, 1024) if TINY else (64, 32768, 1024, 1024)
CHECK_SEQS = 2 if TINY else 4  # sequences checked against the reference at the real size


def kernel(window: int | None, sinks: jax.Array | None):
    fn = paged_decode_reference if TINY else paged_decode_mosaic
    return functools.partial(fn, scale=D ** -0.5, window=window, sinks=sinks)


def check(case, fn, window, sinks) -> float:
    """Relative error (norm) of fn on the case's first page set against the reference, on
    CHECK_SEQS rows (the reference gathers whole contexts: all 64 at 32k would be tens of GB)."""
    q, k, v, bt, lens = case["q"], case["k"], case["v"], case["bts"][0], case["lens"]
    out = jax.jit(fn)(q, k, v, bt, lens)[:CHECK_SEQS].astype(jnp.float32)
    n = CHECK_SEQS
    ref = jax.jit(functools.partial(paged_decode_reference, scale=D ** -0.5, window=window,
                                    sinks=sinks))(q[:n].astype(jnp.float32), k, v, bt[:n], lens[:n])
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    if not err < 1e-2:  # bf16 output rounding is ~2^-9
        raise AssertionError(f"window={window} sinks={sinks is not None}: relative error {err}")
    return err


def measure() -> dict:
    sinks = jax.random.normal(jax.random.key(5), (HQ,), jnp.float32)
    metrics = {}
    long_case = make_paged_case(BATCH, LONG, chain=2 if TINY else None)
    tag_long = f"b{BATCH}x{LONG // 1024}k"
    for name, s in (("", None), ("_sinks", sinks)):
        fn = kernel(WINDOW, s)
        metrics[f"decode_window1k{name}_check_rel_err"] = check(long_case, fn, WINDOW, s)
        metrics[f"decode_window1k{name}_{tag_long}_us"] = time_paged(fn, long_case) * 1e6
    metrics[f"decode_full_{tag_long}_us"] = time_paged(kernel(None, None), long_case) * 1e6
    del long_case
    short_case = make_paged_case(BATCH, SHORT, chain=2 if TINY else None)
    metrics["decode_full_check_rel_err"] = check(short_case, kernel(None, None), None, None)
    full_us = time_paged(kernel(None, None), short_case) * 1e6
    metrics[f"decode_full_b{BATCH}x1k_us"] = full_us
    metrics["decode_window1k_over_full1k"] = metrics[f"decode_window1k_{tag_long}_us"] / full_us
    return {k: round(v, 4) for k, v in metrics.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    results_io.add_save_arg(parser, "families_<gpu>")
    args = parser.parse_args(argv)
    if not TINY:
        warm_up_gpu()
    metrics = measure()
    print(json.dumps(metrics, indent=1), flush=True)
    if args.save:
        name = args.name or f"families_{results_io.device_slug()}"
        path = Path(args.save) / f"{name}.json"
        stored = json.loads(path.read_text()) if path.is_file() else {}
        config = dict(stored.get("config", {}), window_decode=dict(
            batch=BATCH, long_context=LONG, short_context=SHORT, window=WINDOW, hq=HQ, hkv=HKV,
            head_dim=D, page=PAGE, dtype="bfloat16", tiny=TINY,
            kernel="reference" if TINY else "mosaic"))
        results_io.save(args.save, name, config=config,
                        metrics={**stored.get("metrics", {}), **metrics})


if __name__ == "__main__":
    main()
