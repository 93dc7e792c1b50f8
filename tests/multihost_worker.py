"""One process of the two-process tensor-parallel check (tests/test_parallel.py): joins a
jax.distributed run on localhost through the engine's own flags, serves the llama fixture with
TP = 2 across the two processes (one CPU device each, gloo collectives) and prints its greedy
tokens as JSON.

    python tests/multihost_worker.py PORT PROCESS_ID
"""

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# Optimization level 0: compile-bound tiny programs, as in tests/conftest.py.
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=1 "
                           "--xla_backend_optimization_level=0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from jaxinfer import LLM, SamplingParams  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "models" / "llama"


def main() -> None:
    port, pid = sys.argv[1], int(sys.argv[2])
    golden = np.load(FIXTURE / "golden.npz")
    llm = LLM(str(FIXTURE), dtype="float32", tensor_parallel_size=2, max_num_seqs=4,
              max_num_batched_tokens=64, num_blocks=64, block_size=4, warmup=False,
              compilation_cache_dir=None, coordinator_address=f"127.0.0.1:{port}",
              num_processes=2, process_id=pid)
    prompts = [golden["greedy_prompt"].tolist(), golden["prompt_1"].tolist()]  # as parallel_checks
    outs = llm.generate(prompts, SamplingParams(max_tokens=len(golden["greedy_tokens"]),
                                                temperature=0, ignore_eos=True), use_tqdm=False)
    print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                      "local_devices": jax.local_device_count(),
                      "tokens": [o.outputs[0].token_ids for o in outs]}))


if __name__ == "__main__":
    main()
