"""The kernel table under tensor parallelism, run by tests/test_kernel_table.py in a subprocess
with 2 CPU devices: a TP = 2 engine (with and without an fp8 KV cache) whose table's norm slot is
a counting kernel (norm_spy.py) keeps that slot under the sharding wrappers, calls it in its steps
and decodes the tokens of the same engine on the jnp norm. Prints one JSON object.

    python tests/kernel_table_checks.py
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from cpu_devices import start_jax  # noqa: E402

jax = start_jax(2)

import numpy as np  # noqa: E402

import norm_spy  # noqa: E402
from jaxinfer import LLM, SamplingParams  # noqa: E402

FIXTURES = HERE / "fixtures" / "models"


def generate(kv_cache_dtype: str) -> tuple[list[int], object]:
    model = FIXTURES / "llama"
    prompt = np.load(model / "golden.npz")["greedy_prompt"].tolist()
    llm = LLM(str(model), tensor_parallel_size=2, dtype="float32", max_num_seqs=2,
              max_num_batched_tokens=64, num_blocks=64, block_size=4, warmup=False,
              compilation_cache_dir=None, decode_steps_per_call=1, kv_cache_dtype=kv_cache_dtype,
              kv_cache_scales="1.0" if kv_cache_dtype != "auto" else "auto")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids), llm.engine.runner.kernels


def main() -> None:
    out = {}
    for kv in ("auto", "fp8"):
        want, _ = generate(kv)
        norm_spy.install()
        before = len(norm_spy.CALLS)
        got, kernels = generate(kv)
        norm_spy.restore()
        out[kv] = {"tokens": got, "reference_tokens": want,
                   "norm_is_the_kernel": kernels.add_rms_norm is norm_spy.counted_norm,
                   "attention": kernels.attention.name, "norm_calls": len(norm_spy.CALLS) - before}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
