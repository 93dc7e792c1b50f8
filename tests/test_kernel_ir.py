"""The production kernels lower, on the CPU for CUDA, to the Mosaic GPU and Triton modules whose
digests tests/fixtures/kernel_ir.json holds (jaxinfer/bench/profile/mosaic_ir.py): a change meant
to leave the kernels alone (a move, a rename, a dispatch change) leaves their lowered modules
byte-identical.

Here the cheap ones: the fp8 decode kernel at batch 64 x 4096 (one split: its own output store),
the e4m3 grouped matmuls at decode rows and the Triton add + RMSNorm.
`python -m jaxinfer.bench.profile.mosaic_ir --check` compares every kernel (the flash prefill ones
take ~30 s each to lower); after a deliberate kernel change, checked on the H200,
`python -m jaxinfer.bench.profile.mosaic_ir --digest` rewrites them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re

import pytest

from jaxinfer.bench.profile import mosaic_ir

CHEAP = ("decode-fp8-b64", "gmm-decode-fp8", "rms-norm")


@functools.cache
def text(kernel: str) -> str:
    return mosaic_ir.kernel_text(kernel)


def test_every_kernel_has_a_digest():
    assert set(json.loads(mosaic_ir.DIGESTS.read_text())) == set(mosaic_ir.KERNELS)


@pytest.mark.parametrize("kernel", CHEAP)
def test_kernel_lowers_to_its_digest(kernel):
    want = json.loads(mosaic_ir.DIGESTS.read_text())[kernel]
    assert hashlib.sha256(text(kernel).encode()).hexdigest() == want, (
        f"{kernel}'s lowered module changed: diff `python -m jaxinfer.bench.profile.mosaic_ir "
        f"--kernel {kernel}` "
        f"against the last commit's, and if the change is meant, run `--digest`")


def test_fp8_decode_has_no_cta_barrier_past_the_warpgroup_split():
    """A CTA-wide barrier (bar.sync 0) that only some warpgroups reach never completes (a
    thread-collective `run_scoped` inside one warpgroup's code once hung the kernel on the H200;
    the interpreter does not model it). Every CTA-wide barrier must come before the first
    `setmaxnreg`, where the warpgroups' code diverges."""
    [decode] = text("decode-fp8-b64").split("// ----- next kernel -----")
    split = decode.index("setmaxnreg")
    barriers = [m.start() for m in re.finditer(r'gpu\.barrier"', decode)]
    assert barriers and all(i < split for i in barriers), (len(barriers), split)
