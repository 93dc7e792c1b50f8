"""FP8 matmuls alone on Llama-3-8B's shapes, beside the HBM read ceiling measured in the same run:
XLA's weight-only dot (what decode steps run) per projection shape, the bf16 LM head, and the
prefill ratio (FP8 W8A8 over bf16).

    PYTHONUNBUFFERED=1 jaxinfer bench kernels --only weight-only -- [--deadline-s 60]
        [--rows 8,1,64] [--prefill-layers 1] [--parts decode,prefill,head,rows] [--save [DIR]]

Measured in --parts order until --deadline-s (the record is rewritten after each figure):
  read_ceiling_tbs  XLA sum over 8 GiB of bf16 (kernel_decode.read_ceiling_tbps), always first;
  decode   8 rows (the batch-1 decode bucket): XLA's weight-only dot on e4m3 weights
           (`xla_dequant_<shape>_m8`), in TB/s of weight bytes and us per call, with
           `..._frac_of_ceiling`; `xla_dequant_m8_layer_us`: one layer's projections (q, o, 2 kv,
           2 gate_up, down);
  prefill  M = 2048 through --prefill-layers layers of the seven projections (quant.py's
           stack), bf16 and FP8 W8A8: ms, TF/s and `prefill_matmul_fp8_over_bf16`;
  head     the bf16 LM head [in, out] at 8 rows through XLA's dot;
  rows     XLA's weight-only dot at the other --rows.
Each timed call runs over enough distinct weight copies (>= 512 MB) that nothing is served from L2,
unrolled in one jit, and calls are queued without host synchronisation (kernel_decode's timing).
The Pallas weight-only kernel this script once compared (33-45 % of the ceiling against XLA's
60-72 %, `results/weight_only_h200.json`) was removed; git history has it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from jaxinfer.bench import results_io

# name -> (N, K) of Llama-3-8B's projections as the model calls them, and how many per layer.
SHAPES = {"gate_up": (14336, 4096), "down": (4096, 14336), "q_o": (4096, 4096), "kv": (1024, 4096)}
PER_LAYER = {"gate_up": 2, "down": 1, "q_o": 2, "kv": 2}
HEAD = (128256, 4096)
MIN_BYTES = 512 << 20


def _timed(fn, *args) -> float:
    """Seconds per call, queued (kernel_decode's `_queued_time`)."""
    from jaxinfer.bench.kernel_decode import _queued_time
    return _queued_time(lambda _: fn(*args), None)


def _weights(n: int, k: int):
    """Distinct e4m3 weight copies, >= MIN_BYTES in all, and one scale vector. Finite values:
    magnitude bytes in [0, 100] (|w| <= 48) and a random sign (a negative int8 bitcast as-is
    would make byte 0xFF, e4m3fn's NaN)."""
    import jax
    import jax.numpy as jnp
    copies = max(1, -(-MIN_BYTES // (n * k)))

    def bits(key):
        b = jax.random.randint(key, (n, k), -100, 101, jnp.int32)
        return jnp.where(b < 0, -b - 128, b).astype(jnp.int8)  # -b - 128: sign bit | |b|
    make = jax.jit(lambda key: jax.lax.bitcast_convert_type(bits(key), jnp.float8_e4m3fn))
    return [make(jax.random.key(i)) for i in range(copies)], jnp.full((n,), 1e-3, jnp.float32)


def _xla_dequant_fn():
    import jax

    from jaxinfer.model.quant.ops import quantized_matmul
    return jax.jit(lambda x, s, *ws: tuple(quantized_matmul(x, w, s, impl="dequant") for w in ws))


def _prefill(m: dict, layers: int) -> None:
    """M = 2048 through `layers` layers of the seven projections: bf16 and FP8 W8A8."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.bench.presets import LLAMA3_8B
    from jaxinfer.bench.suites.quant import _layer_stack_fn, _projections
    from jaxinfer.model.quant.ops import quantize
    shapes = _projections(LLAMA3_8B)
    normal = jax.jit(lambda key, shape: (jax.random.normal(key, shape) * 0.02).astype(jnp.bfloat16),
                     static_argnums=1)
    bf16 = [{name: normal(jax.random.key(li * 16 + i), shape)
             for i, (name, shape) in enumerate(shapes.items())} for li in range(layers)]
    fp8 = [{} for _ in range(layers)]
    for li, layer in enumerate(bf16):
        for name, w in layer.items():
            fp8[li][name], fp8[li][name + "_scale"] = quantize(w, "fp8")
    flops = 2 * 2048 * layers * sum(n * k for n, k in shapes.values())
    x = jax.random.normal(jax.random.key(0), (2048, LLAMA3_8B["hidden_size"]), jnp.bfloat16)
    for impl, params in (("bf16", bf16), ("fp8", fp8)):
        sec = _timed(_layer_stack_fn(impl), x, params)
        m[f"prefill_{impl}_m2048_ms"] = round(sec * 1e3, 3)
        m[f"prefill_{impl}_m2048_tflops"] = round(flops / sec / 1e12, 1)
    m["prefill_matmul_fp8_over_bf16"] = round(m["prefill_bf16_m2048_ms"] / m["prefill_fp8_m2048_ms"], 3)
    m["prefill_layers"] = layers
    print(json.dumps({k: v for k, v in m.items() if k.startswith("prefill")}), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadline-s", type=float, default=60.0,
                    help="stop starting new measurements past this many seconds")
    ap.add_argument("--rows", default="8,1,64", help="row counts (8: the decode part)")
    ap.add_argument("--prefill-layers", type=int, default=1, help="0: skip the prefill ratio")
    ap.add_argument("--parts", default="decode,prefill,head,rows",
                    help="what to measure, in order: decode, prefill, head, rows")
    results_io.add_save_arg(ap, "weight_only_<gpu>")
    args = ap.parse_args(argv)
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    from jaxinfer.bench.kernel_decode import read_ceiling_tbps

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - start)

    m: dict = {}
    rows = [int(r) for r in args.rows.split(",")]

    def save() -> None:
        m["wall_s"] = round(time.perf_counter() - start, 1)
        if "read_ceiling_tbs" in m:
            for key in [k for k in m if k.endswith("_tbs") and k != "read_ceiling_tbs"]:
                m[key.replace("_tbs", "_frac_of_ceiling")] = round(m[key] / m["read_ceiling_tbs"], 3)
        if all(f"xla_dequant_{s}_m8_us" in m for s in SHAPES):
            m["xla_dequant_m8_layer_us"] = round(sum(
                c * m[f"xla_dequant_{s}_m8_us"] for s, c in PER_LAYER.items()), 1)
        if args.save:
            results_io.save(args.save, args.name or "weight_only_h200", metrics=m, config={
                "shapes": {**SHAPES, "lm_head": HEAD}, "per_layer": PER_LAYER, "rows": rows,
                "weights": "float8_e4m3fn, per-channel scales; >= 512 MB of copies per call"})

    def measure(key: str, fn, x, s, ws, nbytes: int | None = None) -> None:
        sec = _timed(fn, x, s, *ws)
        m[key + "_tbs"] = round((nbytes or len(ws) * ws[0].size) / sec / 1e12, 3)
        m[key + "_us"] = round(sec / len(ws) * 1e6, 2)
        print(json.dumps({key + "_tbs": m[key + "_tbs"], key + "_us": m[key + "_us"],
                          "at_s": round(time.perf_counter() - start, 1)}), flush=True)

    m["read_ceiling_tbs"] = round(read_ceiling_tbps(), 3)
    print(json.dumps(m), flush=True)
    save()  # a part cut by the caller's time limit keeps what came before it
    parts = args.parts.split(",")

    def per_shape(row_counts) -> None:
        """XLA's weight-only dot per shape and row count."""
        for name, (n, k) in SHAPES.items():
            if left() < 3:
                return
            ws, s = _weights(n, k)
            for r in row_counts:
                x = jax.random.normal(jax.random.key(r), (r, k), jnp.bfloat16)
                if left() > 2:
                    measure(f"xla_dequant_{name}_m{r}", _xla_dequant_fn(), x, s, ws)
            save()
            del ws

    for part in parts:
        if part == "decode":  # the batch-1 decode bucket
            per_shape([8])
        elif part == "prefill" and args.prefill_layers and left() > 8:
            _prefill(m, args.prefill_layers)
            save()
        elif part == "head" and left() > 4:  # the bf16 LM head, [in, out] as the model holds it
            n, k = HEAD
            head = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
            x = jax.random.normal(jax.random.key(8), (8, k), jnp.bfloat16)
            xla = jax.jit(lambda x, _, w: (jnp.dot(x, w),))
            measure("xla_bf16_lm_head_m8", xla, x, None, [head], 2 * n * k)
            save()
            del head
        elif part == "rows":  # the other row counts
            per_shape([r for r in rows if r != 8])
    save()
    print("\n".join(f"{k} | {v}" for k, v in m.items() if not k.endswith("_us")))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
