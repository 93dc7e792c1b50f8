"""The bundled demo models (checkpoints/demo-target, checkpoints/demo-draft): they load through
jaxinfer's loader, reproduce their committed greedy continuations, keep their held-out perplexity,
and the training script that made them still trains (toy scale)."""

import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.config import load_config
from jaxinfer.model.transformer import train_forward
from jaxinfer.model.tokenizer import Tokenizer
from jaxinfer.model.weights import load_params

REPO = Path(__file__).resolve().parent.parent
CKPT = REPO / "checkpoints"
MODELS = {"target": CKPT / "demo-target", "draft": CKPT / "demo-draft"}
# Perplexity on checkpoints/heldout_sample.txt (start of a held-out stdlib file), float32 on the CPU,
# measured when the models were committed: target 8.82, draft 10.87 (1024 tokens of chunk.py; the
# first tokens of a file have little context). The bounds leave ~6%; a broken loader or model lands
# far above them (random weights: ~4100). The golden continuations catch subtler changes.
PPL_BOUND = {"target": 9.4, "draft": 11.6}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODELS["target"])


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    cfg = load_config(MODELS[request.param])
    params = load_params(MODELS[request.param], cfg, jnp.float32, progress=False)
    return request.param, cfg, params, jax.jit(lambda p, t: train_forward(p, cfg, t))


def greedy(logits_fn, params, prompt_ids: list[int], n_new: int) -> list[int]:
    """Greedy decoding with a dense forward per step over a fixed-length buffer (causal attention
    keeps the unwritten tail from affecting the positions read)."""
    seq = np.zeros((1, len(prompt_ids) + n_new), np.int32)
    seq[0, :len(prompt_ids)] = prompt_ids
    for i in range(len(prompt_ids), seq.shape[1]):
        seq[0, i] = int(jnp.argmax(logits_fn(params, jnp.asarray(seq))[0, i - 1]))
    return seq[0, len(prompt_ids):].tolist()


def test_tokenizer_and_model_configs(tokenizer):
    assert tokenizer.vocab_size == 4096
    assert tokenizer.eos_token_ids == (0, 2)  # <|endoftext|>, <|im_end|>
    text = "def f(x):\n    return {'é': x}  # ünïcode\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(chat)[0] == 1  # <|im_start|> is one special token
    target, draft = (load_config(MODELS[m]) for m in ("target", "draft"))
    assert 10e6 <= target.num_params() <= 30e6
    assert 3 <= target.num_params() / draft.num_params() <= 12
    assert target.vocab_size == draft.vocab_size == tokenizer.vocab_size
    size = sum(f.stat().st_size for m in MODELS.values() for f in m.glob("*.safetensors"))
    assert size <= 35e6, f"bundled weights take {size / 1e6:.1f} MB"


def test_greedy_continuation_matches_golden(model, tokenizer):
    name, _, params, logits_fn = model
    golden = json.loads((CKPT / "demo_golden.json").read_text())
    for case in golden["cases"]:
        assert tokenizer.encode(case["prompt"]) == case["prompt_ids"]
        ids = greedy(logits_fn, params, case["prompt_ids"], golden["tokens"])
        assert ids == case[name]["ids"], (
            f"{name} now continues {case['prompt']!r} with {tokenizer.decode(ids)!r}, "
            f"golden {case[name]['text']!r}")
        assert tokenizer.decode(ids) == case[name]["text"]
    # Deterministic: the same prompt twice gives the same tokens.
    case = golden["cases"][0]
    assert greedy(logits_fn, params, case["prompt_ids"], 8) == case[name]["ids"][:8]


def test_heldout_perplexity_below_bound(model, tokenizer):
    name, cfg, params, logits_fn = model
    ids = tokenizer.encode((CKPT / "heldout_sample.txt").read_text())
    ids = np.asarray(ids[:cfg.max_position_embeddings + 1], np.int32)[None]
    assert ids.shape[1] > 1000
    logp = jax.nn.log_softmax(logits_fn(params, jnp.asarray(ids[:, :-1])), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(ids[:, 1:, None]), axis=-1).mean()
    ppl = math.exp(float(nll))
    assert ppl < PPL_BOUND[name], f"{name}: held-out perplexity {ppl:.3f} >= bound {PPL_BOUND[name]}"


def test_training_script_toy_run_lowers_the_loss(tmp_path, tokenizer):
    """A few steps of checkpoints/train_demo.py at toy scale on a small corpus made of this
    repository's own source, in two jobs (the first stops after 20 of 40 steps and saves its
    state, the second resumes it): the held-out loss falls well below its start (ln 4096 = 8.3),
    and the output directory loads like any HF checkpoint."""
    from checkpoints import train_demo
    data = tmp_path / "data"
    (data / "tokenizer").mkdir(parents=True)
    for f in train_demo.TOKENIZER_FILES:
        shutil.copyfile(MODELS["target"] / f, data / "tokenizer" / f)
    eot = train_demo.ENDOFTEXT_ID
    texts = [p.read_text() for p in sorted((REPO / "jaxinfer").rglob("*.py"))]
    train = [t for text in texts for t in (*tokenizer.encode(text), eot)]
    np.save(data / "train.npy", np.asarray(train, np.uint16))
    np.save(data / "heldout.npy", np.asarray(tokenizer.encode((CKPT / "heldout_sample.txt").read_text()),
                                             np.uint16))
    out = tmp_path / "toy"
    argv = ["--toy", "--data", str(data), "--out", str(out), "--max-steps", "40", "--eval-windows", "8",
            "--state", str(tmp_path / "state")]
    first = train_demo.main([*argv, "--job-steps", "20"])
    assert (first["steps"], first["done"]) == (20, False)
    summary = train_demo.main([*argv, "--resume"])
    assert (summary["steps"], summary["done"], summary["schedule_steps"]) == (40, True, 40)
    assert [e["step"] for e in summary["evals"]] == [0, 10, 20, 30, 40]
    evals = [e["heldout_loss"] for e in summary["evals"]]
    assert evals[0] > 7.5, evals
    assert evals[-1] < evals[0] - 0.8, evals
    assert summary["losses"][-1]["loss"] < summary["losses"][0]["loss"], summary["losses"]
    cfg = load_config(out)
    params = load_params(out, cfg, jnp.float32, progress=False)
    assert cfg.num_params() == summary["params"]
    assert params["embed"]["embedding"].shape == (4096, cfg.hidden_size)
    assert Tokenizer.from_dir(out).eos_token_ids == (0, 2)


def test_wsd_schedule_holds_the_peak_then_decays_linearly():
    from checkpoints.train_demo import lr_at
    lrs = [lr_at(s, 110, 1.0, 10, 0.1, "wsd", 0.3) for s in range(110)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10:80] == [1.0] * 70  # decay: the last 30% of the 100 post-warmup steps
    assert lrs[80:] == pytest.approx([1 - 0.9 * (s - 80) / 30 for s in range(80, 110)])


def test_readme_example_is_the_served_target_continuation():
    """README.md's first example (rewritten by `python -m checkpoints.measure_demo --readme-only`)
    starts with the target's golden continuation of the same prompt: a retrained target whose
    goldens were refreshed without the README fails here."""
    import re
    from checkpoints.measure_demo import README_BLOCK
    block = README_BLOCK.search((REPO / "README.md").read_text())
    assert block, "README.md lost its <!-- demo-example --> markers"
    request = json.loads(re.search(r"-d '(\{.*\})'", block.group(0)).group(1))
    text = json.loads(re.search(r'"text": ("(?:[^"\\]|\\.)*")', block.group(0)).group(1))
    golden = {c["prompt"]: c["target"]["text"]
              for c in json.loads((CKPT / "demo_golden.json").read_text())["cases"]}
    assert request["prompt"] in golden, "the README's prompt has no golden continuation"
    assert text.startswith(golden[request["prompt"]])
