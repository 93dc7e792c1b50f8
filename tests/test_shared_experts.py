"""Shared experts stored as extra experts of the routed stacks (model/shared_experts.py): the
rewrite of host (numpy) and device trees alike, only where a plain shared MLP exists, the
split MLP's sum equal to the whole one, and an engine on them that decodes alike and takes
separate updates."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.shared_experts import fuse_shared_experts, has_shared_mlp

E, H, F, S = 4, 8, 6, 2


def _tree(xp):
    rng = np.random.default_rng(0)
    r = lambda *shape: xp.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    moe = {"router": r(H, E), "w_gate": r(E, H, F), "w_up": r(E, H, F), "w_down": r(E, F, H),
           "shared_experts": {"gate_proj": {"kernel": r(H, S * F)},
                              "up_proj": {"kernel": r(H, S * F)},
                              "down_proj": {"kernel": r(S * F, H)}}}
    return {"embed": r(3, H), "layers_0": {"moe": moe}, "layers_1": {"mlp": {"w": r(2, 2)}}}


def _swiglu(x, g, u, d):
    return (jax.nn.silu(x @ g) * (x @ u)) @ d


def test_the_split_experts_sum_to_the_shared_mlp():
    tree = _tree(jnp)
    out = fuse_shared_experts(tree)
    moe, shared = out["layers_0"]["moe"], tree["layers_0"]["moe"]["shared_experts"]
    assert "shared_experts" not in moe and moe["w_gate"].shape == (E + S, H, F)
    assert not has_shared_mlp(out) and has_shared_mlp(tree)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, H)), jnp.float32)
    whole = _swiglu(x, shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"],
                    shared["down_proj"]["kernel"])
    parts = sum(_swiglu(x, moe["w_gate"][E + s], moe["w_up"][E + s], moe["w_down"][E + s])
                for s in range(S))
    np.testing.assert_allclose(np.asarray(parts), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(moe["w_down"][:E]),
                                  np.asarray(tree["layers_0"]["moe"]["w_down"]))
    assert out["layers_1"] is tree["layers_1"]


def test_host_trees_rewrite_alike_and_twice_is_once():
    host, device = fuse_shared_experts(_tree(np)), fuse_shared_experts(_tree(jnp))
    for name in ("w_gate", "w_up", "w_down"):
        assert isinstance(host["layers_0"]["moe"][name], np.ndarray)
        np.testing.assert_array_equal(host["layers_0"]["moe"][name],
                                      np.asarray(device["layers_0"]["moe"][name]))
    assert fuse_shared_experts(host)["layers_0"]["moe"]["w_gate"].shape[0] == E + S


def test_quantized_shared_mlps_stay_separate():
    tree = _tree(jnp)
    tree["layers_0"]["moe"]["shared_experts"]["gate_proj"] = {"weight": jnp.zeros((S * F, H)),
                                                              "scale": jnp.ones((S * F,))}
    assert "shared_experts" in fuse_shared_experts(tree)["layers_0"]["moe"]


def test_an_engine_on_stacked_shared_experts_decodes_alike_and_takes_separate_updates():
    from test_engine_support import make_engine, prompt_ids, run_all
    from test_mla_engine import model

    from jaxinfer.sampling_params import SamplingParams

    cfg, params = model()  # a tiny DeepSeek-V3 with one shared expert
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(engine):
        for i in range(3):
            engine.add_request(f"r{i}", prompt_ids(40 + i, 7), greedy)
        return {rid: out[0][0] for rid, out in run_all(engine).items()}

    separate = make_engine(model=(cfg, params))
    stacked = make_engine(model=(cfg, fuse_shared_experts(params)))
    assert not has_shared_mlp(stacked.runner.params)
    assert tokens(stacked) == tokens(separate)
    update = jax.tree.map(lambda a: np.asarray(a) * 0.5, params)  # separate, on the host
    stacked.update_weights(update)
    separate.update_weights(update)
    assert not has_shared_mlp(stacked.runner.params)
    assert tokens(stacked) == tokens(separate)


def test_a_family_with_its_own_moe_keeps_the_checkpoint_layout():
    """Llama 4's MoE layer (llama4.py) reads its shared expert as a separate MLP: the serving
    rewrite leaves it alone, while the shared MoE's families are rewritten."""
    from jaxinfer.model.config import load_config
    from jaxinfer.model.shared_experts import stackable
    fixtures = Path(__file__).parent / "fixtures" / "models"
    assert not stackable(load_config(fixtures / "llama4"))
    assert stackable(load_config(fixtures / "deepseek_v3"))
    assert stackable(None)
