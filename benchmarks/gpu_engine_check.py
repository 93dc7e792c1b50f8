"""The engine on the GPU: greedy parity between attention backends, then offline throughput.

    PYTHONPATH=. python3 benchmarks/gpu_engine_check.py [--skip-throughput]

1. Parity: the bundled demo model (bf16) generates greedily for 16 held-out code prompts with the
   `reference` backend and with the `mosaic` kernels; prints how many of the 16 continuations are
   token-identical and, for the others, where they first differ (bf16 kernels round q and P, so a
   near-tie can flip a token; after that the continuations legitimately diverge).
2. Throughput: benchmarks/bench_throughput.py with the mosaic backend, 256 prompts x 256 in / 256
   out, with --decode-steps-per-call 1 and 8 (each in its own process; the on-disk compilation
   cache is shared).
Writes $OUT/gpu_engine_check.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parity(out: dict) -> None:
    from jaxinfer.engine import LLM
    from jaxinfer.sampling_params import SamplingParams

    text = (ROOT / "checkpoints" / "heldout_sample.txt").read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    prompts = ["\n".join(lines[i:i + 3]) for i in range(0, 48, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "mosaic"):
        t0 = time.perf_counter()
        llm = LLM(attention_backend=backend, dtype="bfloat16", max_num_seqs=16,
                  max_num_batched_tokens=512, warmup=False, num_blocks=4096)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        out[f"parity_{backend}_s"] = round(time.perf_counter() - t0, 1)
    same = [a == b for a, b in zip(tokens["reference"], tokens["mosaic"])]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(tokens["reference"], tokens["mosaic"])]
    out["parity"] = dict(identical=sum(same), of=len(same), first_difference_at=first_diff)
    print(f"greedy parity reference vs mosaic: {sum(same)}/{len(same)} identical; first differences "
          f"at {[d for d in first_diff if d is not None]}", flush=True)


def throughput(out: dict) -> None:
    for steps in (1, 8):
        path = Path(os.environ.get("OUT", "/tmp")) / f"throughput_steps{steps}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_throughput.py"), "--attention-backend",
               "mosaic", "--dtype", "bfloat16", "--input-len", "256", "--output-len", "256",
               "--num-prompts", "256", "--num-blocks", "16384", "--decode-steps-per-call", str(steps), "--output-json", str(path)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
        print(proc.stdout[-1500:], proc.stderr[-1500:] if proc.returncode else "", flush=True)
        out[f"throughput_steps{steps}"] = json.loads(path.read_text()) if path.exists() else proc.stderr[-2000:]
        out[f"throughput_steps{steps}_wall_s"] = round(time.perf_counter() - t0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    import jax
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    dest = Path(os.environ.get("OUT", "/tmp")) / "gpu_engine_check.json"
    sections = [parity] + ([] if args.skip_throughput else [throughput])
    for section in sections:
        try:
            section(out)
        except Exception as e:  # noqa: BLE001 - keep the other section's figures
            out[f"{section.__name__}_error"] = repr(e)[-2000:]
            print(section.__name__, "FAILED:", repr(e)[-2000:], flush=True)
        dest.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("throughput_steps") or k.endswith("_s")}, indent=1))
    for steps in (1, 8):
        r = out.get(f"throughput_steps{steps}")
        if isinstance(r, dict):
            print(f"decode-steps-per-call {steps}: {r['requests_per_second']:.2f} req/s, "
                  f"{r['output_tokens_per_second']:.0f} output tok/s, {r['tokens_per_second']:.0f} total tok/s")


if __name__ == "__main__":
    main()
