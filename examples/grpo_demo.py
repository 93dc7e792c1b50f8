"""GRPO-style RL fine-tuning of the demo model, with jaxinfer sampling the rollouts in-process.

Each step: jaxinfer samples a group of completions per prompt with their logprobs
(`LLM.generate(..., SamplingParams(n=group, logprobs=0))`), `to_rollout_batch` pads them into
arrays, each completion is scored by a toy reward, advantages are the rewards normalised within
their group (GRPO: no value network), one AdamW step on the clipped policy-gradient objective
updates float32 master weights (the model's dense `train_forward`), and `LLM.update_weights` hands
them to the engine -- no new engine, no recompilation -- for the next step's rollouts.

Reward: the share of the completion's line prefixes that parse as Python (`ast.parse` of the
prompt plus the completion's first k lines, k = 1..lines), in [0, 1]: dense enough to move at this
size, unlike "the whole completion parses", which a 48-token cut almost never does.

The objective's ratio compares the training forward's logprobs with the ones the engine sampled
with; with one gradient step per batch it is 1 up to numerics, and `logprob_drift` (mean absolute
difference per token) reports how closely the engine's logprobs match the trainer's.

    JAX_PLATFORMS=cpu python -m examples.grpo_demo                  # a few minutes on a CPU
    python -m examples.grpo_demo --steps 40 --group 16 --save out/   # an accelerator

Writes the reward curve to DIR/grpo_demo_<device>.png (needs matplotlib, the `bench` extra;
skipped without it) and, with --save DIR, the run's record there (jaxinfer/bench/results_io.py).
DIR is ./bench_results without --save: a demo run never rewrites the checkout's tracked record,
which only `--save benchmarks/results` replaces.
"""

from __future__ import annotations

import argparse
import ast
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.bench import results_io
from jaxinfer.frontends.llm import LLM
from jaxinfer.engine.rollout import to_rollout_batch
from jaxinfer.model.transformer import train_forward
from jaxinfer.sampling_params import SamplingParams

PROMPTS = ["import os\n", "def main():\n", "class Config:\n", "for i in range(10):\n",
           "if __name__ == '__main__':\n", "with open(path) as f:\n", "try:\n",
           "def __init__(self, name):\n"]


def reward(code: str) -> float:
    """Share of the line prefixes of `code` that parse as Python."""
    lines = code.split("\n")
    ok = 0
    for k in range(1, len(lines) + 1):
        try:
            ast.parse("\n".join(lines[:k]))
            ok += 1
        except (SyntaxError, ValueError):  # ValueError: a NUL byte
            pass
    return ok / len(lines)


def group_advantages(rewards: np.ndarray, group: np.ndarray) -> np.ndarray:
    """(r - mean of its group) / (std of its group + eps): 0 for a group of equal rewards."""
    adv = np.zeros_like(rewards)
    for g in np.unique(group):
        r = rewards[group == g]
        adv[group == g] = (r - r.mean()) / (r.std() + 1e-6)
    return adv


def make_train_step(cfg, optimizer, clip: float):
    def loss_fn(params, tokens, mask, old_logprobs, adv):
        logits = train_forward(params, cfg, tokens[:, :-1]).astype(jnp.float32)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
        ratio = jnp.exp(logp - old_logprobs)
        a = adv[:, None]
        objective = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
        n = jnp.maximum(mask.sum(), 1)
        drift = jnp.where(mask, jnp.abs(logp - old_logprobs), 0).sum() / n
        return -jnp.where(mask, objective, 0).sum() / n, drift

    @jax.jit
    def train_step(params, opt_state, tokens, mask, old_logprobs, adv):
        (loss, drift), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, tokens, mask, old_logprobs, adv)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, drift

    return train_step


def plot(path: Path, rewards: list[float], title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the `bench` extra): no plot")
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(rewards)), rewards, marker="o")
    ax.set_xlabel("step (rollouts sampled before that step's update)")
    ax.set_ylabel("mean reward")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/demo-target")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, metavar="DIR",
                    help="write the run's record and plot to DIR (benchmarks/results replaces "
                         "the checkout's tracked record; default: no record, plot to "
                         "./bench_results)")
    ap.add_argument("--name", "--record", dest="name", default=None,
                    help="the record's name (default: grpo_demo_<device>)")
    args = ap.parse_args()

    llm = LLM(model=args.model, dtype="float32", max_model_len=256, block_size=16,
              num_blocks=16 * len(PROMPTS) * args.group, max_num_seqs=len(PROMPTS) * args.group,
              max_num_batched_tokens=256, warmup=False, seed=args.seed)
    cfg, tok = llm.engine.cfg, llm.engine.tokenizer
    params = jax.tree.map(jnp.array, llm.engine.runner.params)  # float32 master weights
    optimizer = optax.adamw(args.lr, b1=0.9, b2=0.99, weight_decay=0.0)
    opt_state = optimizer.init(params)
    train_step = make_train_step(cfg, optimizer, args.clip)
    max_prompt = max(len(tok.encode(p)) for p in PROMPTS)

    history = []
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        sp = SamplingParams(n=args.group, temperature=args.temperature, max_tokens=args.max_tokens,
                            logprobs=0, seed=args.seed * 100003 + step)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        t_rollout = time.perf_counter() - t0
        batch = to_rollout_batch(outs, max_prompt_len=max_prompt,
                                 max_completion_len=args.max_tokens)
        texts = [PROMPTS[g] + c.text for g, o in enumerate(outs) for c in o.outputs]
        rewards = np.array([reward(t) for t in texts], np.float32)
        adv = group_advantages(rewards, batch.group)
        tokens, mask, old = batch.packed()
        t1 = time.perf_counter()
        params, opt_state, loss, drift = train_step(params, opt_state, tokens, mask, old, adv)
        llm.update_weights(params)
        jax.block_until_ready(llm.engine.runner.params)
        t_train = time.perf_counter() - t1
        row = dict(step=step, reward=float(rewards.mean()), loss=float(loss),
                   logprob_drift=float(drift), weight_version=int(batch.weight_versions[0]),
                   mean_completion_tokens=float(batch.completion_lens.mean()),
                   rollout_s=round(t_rollout, 2), train_and_update_s=round(t_train, 2))
        history.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)

    rewards = [h["reward"] for h in history]
    slope = float(np.polyfit(np.arange(len(rewards)), rewards, 1)[0]) if len(rewards) > 1 else 0.0
    device = results_io.device_slug()
    name = args.name or f"grpo_demo_{device}"
    png = Path(args.save or "bench_results") / f"{name}.png"
    plotted = plot(png, rewards, f"GRPO demo ({Path(args.model).name}, {len(PROMPTS)} prompts x "
                                 f"{args.group}, {args.max_tokens} tokens, lr {args.lr:g})\n"
                                 f"reward: share of line prefixes that parse as Python")
    print(f"reward: first {rewards[0]:.3f}, last {rewards[-1]:.3f}, mean of last third "
          f"{np.mean(rewards[-max(1, len(rewards) // 3):]):.3f}, linear slope {slope:+.4f}/step")
    if args.save:
        config = {k: v for k, v in vars(args).items() if k not in ("save", "name")}
        config.update(prompts=PROMPTS, engine_dtype="float32", master_dtype="float32")
        results_io.save(args.save, name, config=config, metrics=dict(
            reward_first=rewards[0], reward_last=rewards[-1],
            reward_first_third=float(np.mean(rewards[:max(1, len(rewards) // 3)])),
            reward_last_third=float(np.mean(rewards[-max(1, len(rewards) // 3):])),
            reward_slope_per_step=slope, total_s=round(time.perf_counter() - t_start, 1),
            plot=png.name if plotted else None, per_step=history))


if __name__ == "__main__":
    main()
