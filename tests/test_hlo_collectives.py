"""jaxinfer/bench/profile/hlo_collectives.py on HLO text: collectives found through conditionals, while
loops and the computations they call; the sampler's logits layout rule and its command-buffer
fallback."""

from jax.sharding import PartitionSpec as P

from jaxinfer.bench.profile.hlo_collectives import collectives_in_control_flow, count_collectives
from jaxinfer.parallel.sampling_logits import REPLICATE_MAX_BYTES, logits_spec

HLO = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %all-gather.7 = f32[4]{0} all-gather(%p), channel_id=3, dimensions={0}
}

%branch_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %call.1 = f32[4]{0} call(%p), to_apply=%inner
}

%branch_b (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %ar = f32[4]{0} all-reduce-start(%x), channel_id=2, to_apply=%add
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %ar)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %all-reduce.1 = f32[4]{0} all-reduce(%x), channel_id=1, to_apply=%add
  %pr = pred[] constant(true)
  %conditional.3 = f32[4]{0} conditional(%pr, %all-reduce.1, %x), branch_computations={%branch_a, %branch_b}
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %conditional.3)
  %while.9 = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[4]{0} get-tuple-element(%while.9), index=1
}
"""


def test_collectives_found_under_control_flow_only():
    sites = {(s.op, s.instruction, s.inside) for s in collectives_in_control_flow(HLO)}
    assert sites == {("all-gather", "all-gather.7", ("conditional.3",)),
                     ("all-reduce", "ar", ("while.9",))}
    assert [s.instruction for s in collectives_in_control_flow(HLO, ("conditional",))] == [
        "all-gather.7"]
    assert count_collectives(HLO) == 3


def test_logits_layout_rule():
    class Plan:
        tp = 2
    vocab = 128256
    rows = REPLICATE_MAX_BYTES // (vocab * 4)  # 16: the largest gathered whole
    assert logits_spec(None, 8, vocab) is None
    assert logits_spec(Plan(), rows, vocab) == P()
    assert logits_spec(Plan(), 2 * rows, vocab) == P("tp", None)
    assert logits_spec(Plan(), 2 * rows + 1, vocab) == P()  # rows not divisible by tp
