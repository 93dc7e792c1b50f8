"""bench/profile/mosaic_operands.py on a hand-written optimized HLO module: a Mosaic GPU call's
operands traced to what defines them, a leading-dimension slice's byte offset and alignment."""

from __future__ import annotations

from jaxinfer.bench.profile.mosaic_operands import mosaic_operands

HLO = """HloModule jit_f, entry_computation_layout={(s32[8,64]{1,0}, bf16[4,16]{1,0})->f32[8]{0}}

ENTRY %main.1 (p0: s32[8,41], p1: bf16[4,16]) -> f32[8] {
  %p0 = s32[8,41]{1,0} parameter(0)
  %p1 = bf16[4,16]{1,0} parameter(1)
  %slice.1 = s32[6,41]{1,0} slice(s32[8,41]{1,0} %p0), slice={[2:8], [0:41]}
  %slice.2 = s32[8,20]{1,0} slice(s32[8,41]{1,0} %p0), slice={[0:8], [0:20]}
  %bitcast.3 = bf16[64]{0} bitcast(bf16[4,16]{1,0} %p1)
  %other = f32[8]{0} custom-call(s32[8,41]{1,0} %p0), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %mosaic.2 = f32[8]{0} custom-call(MOSAIC_OPERANDS), custom_call_target="mosaic_gpu_v2"
}
""".replace("MOSAIC_OPERANDS", "s32[6,41]{1,0} %slice.1, s32[8,20]{1,0} %slice.2, "
                               "bf16[64]{0} %bitcast.3")


def test_a_row_slice_view_is_located_and_its_alignment_judged():
    (call,) = mosaic_operands(HLO)  # the Triton call is not a Mosaic one
    assert call["call"] == "mosaic.2"
    rows, cols, flat = call["operands"]
    # Rows 2.. of a [8, 41] int32 table: a view 2 x 41 x 4 = 328 bytes in, not 256-aligned.
    assert rows["opcode"] == "slice" and rows["offset_bytes"] == 328 and rows["aligned"] is False
    assert "offset_bytes" not in cols  # a column cut is copied, not a view
    assert flat["from"] == "p1" and flat["opcode"] == "parameter"  # through the bitcast
    aligned = mosaic_operands(HLO.replace("[2:8]", "[0:6]"))[0]["operands"][0]
    assert aligned["offset_bytes"] == 0 and aligned["aligned"] is True
