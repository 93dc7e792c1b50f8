"""A persistent batch's sampling rows: each field its own array, written once per sequence, padding
rows greedy with every filter off."""

from __future__ import annotations

import numpy as np

from jaxinfer.core.request import Request, Sequence
from jaxinfer.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from jaxinfer.worker.step_inputs import SamplingRows, SamplingTable


def test_rows_carry_each_field_by_name():
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, min_tokens=3,
                            logprobs=2, stop_token_ids=[7])
    req = Request("r", [1, 2, 3, 4], params, seed=2**32 - 1, eos_token_ids=(2,))
    seq = Sequence("r#0", req, 0, [1, 2, 3, 4])
    table = SamplingTable(4)
    seq.slot = 1
    assert table.row_of(seq) == 1
    got = table.rows.take(np.array([1, table.pad]))
    assert got.temperature.tolist() == [np.float32(0.7), 0.0]
    assert got.top_k.tolist() == [5, 0] and got.top_p.tolist() == [np.float32(0.9), 1.0]
    assert got.min_p.tolist() == [np.float32(0.1), 0.0]
    assert got.seed[0] == seq.seed and got.seed.dtype == np.uint32  # exact, not through a float
    assert got.min_tokens.tolist() == [3, 0] and got.prompt_len.tolist() == [4, 0]
    assert got.num_top_logprobs.tolist() == [2, 0]
    assert got.stop_ids[0, :2].tolist() == [2, 7] and (got.stop_ids[1] == -1).all()
    assert got.stop_ids.shape == (2, MAX_STOP_TOKEN_IDS)


def test_greedy_rows_have_zero_temperature():
    rows = SamplingRows.padding(2)
    req = Request("g", [1], SamplingParams(temperature=1e-9), seed=0, eos_token_ids=())
    rows.write(0, Sequence("g#0", req, 0, [1]))
    assert rows.temperature[0] == 0.0
