"""Train one of the bundled demo models (target or draft) on the corpus `build_corpus.py` makes.

Data: `demo_data.PackedBatches`: documents (stdlib files; with `--extra`, each `--stdlib-repeat`
times plus the extra training code of build_corpus.py once) shuffled per epoch with a fixed seed,
concatenated and split into packed sequences of seq_len + 1 tokens; step s's batch is a function
of s alone, so a resumed run reads the same batches.

Model: jaxinfer's own `train_forward` (Llama architecture, tied embeddings, GQA), its attention
`--attention` (auto: cuDNN's fused kernel on a GPU, `pallas_kernels/attention/dense_fused.py`;
the jnp reference materialises the [L, L] scores in float32 and was most of the first models'
step time). Mixed precision: float32 master weights and AdamW moments, bf16 forward/backward.
AdamW's per-step updates (lr * ~1 relative to weights of ~0.02) are below bf16's 8-bit mantissa
resolution late in the schedule, so bf16 master weights would stall; bf16 compute is what the
server runs, so the eval measures the numerics that ship. `--compute-dtype float32` for CPU runs.

Step: one jitted call runs `--steps-per-call` optimizer steps (`lax.scan` over a [S, B, L + 1]
block of batches and their learning rates) with the weights and optimizer state donated, so the
host dispatches, and reads losses back, once per S steps (a 14 M model's step is a few ms: one
dispatch per step would leave the GPU waiting on Python).

Distillation (`--teacher DIR`, for the draft): the loss mixes the cross-entropy against the data
with the cross-entropy against the teacher's next-token distribution (`--distill-weight`), the
teacher running in the same jitted step; matching the target's distribution is what raises the
draft's acceptance in speculative decoding.

Schedule (`--schedule`): linear warmup, then `wsd` (warmup-stable-decay: the peak until the last
`--decay-frac` of the steps, then linear to `--final-lr-frac` of the peak) or `cosine` (to
`--final-lr-frac`). The demo target's held-out perplexity falls most during the decay, and it
memorises the 8.5 M stdlib tokens past ~13 epochs, so its schedule is short enough (`--max-steps
1600`) for the decay to end before that (checkpoints/README.md).
Time-boxed (`--max-seconds`): after `PLAN_AT_STEP` steps the steady-state step time is measured
and the schedule's length fixed to the number of steps that fit before the deadline (capped by
`--max-steps`), leaving time for the evals and saving; should the estimate prove optimistic,
training stops at the deadline anyway and, with `--state DIR`, saves its full state (float32
weights, AdamW moments, best weights, log) there; `--resume` continues it in a later job.
The chosen length is recorded, so `--max-steps N --max-seconds 0` replays a run's schedule.

Output: an HF-format directory (config.json, model.safetensors in bf16, generation_config.json,
tokenizer files) holding the weights with the lowest held-out loss seen at the periodic evals, and
training_log.json (config, schedule, losses, held-out perplexities, tokens, time, throughput).

    python checkpoints/train_demo.py --model target --max-steps 1600 --out checkpoints/demo-target
    python checkpoints/train_demo.py --toy --data DIR --out DIR   # a few seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from checkpoints.demo_data import ENDOFTEXT_ID, PackedBatches, heldout_windows, split_documents
from checkpoints.train_state import restore_state, save_state
from jaxinfer.model.config import config_from_dict, load_config
from jaxinfer.model.transformer import init_params, train_forward
from jaxinfer.model.weights import load_params, save_safetensors
from jaxinfer.model.kernel_table import REFERENCE_KERNELS
from pallas_kernels.attention.dense_fused import with_fused_dense

REPO = Path(__file__).resolve().parent.parent

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# Steps TIMED_FROM_STEP..PLAN_AT_STEP are timed to fix the schedule's length. Not earlier: the
# first calls overlap compilation and host setup and make steps look faster or slower than the
# steady state (the committed models' run timed steps 10..30 and overestimated the steps that fit
# by 6% (target) and 33% (draft), so their cosines stopped early; see checkpoints/README.md).
TIMED_FROM_STEP, PLAN_AT_STEP = 50, 100
IM_END_ID = 2
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of one H200 (SXM), for the record's MFU

# HF config.json fields of each model (the rest is filled in by `hf_config`).
ARCHITECTURES = {
    "target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    "draft": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64),
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}
# Training hyperparameters per model; command-line flags override them.
HPARAMS = {
    "target": dict(seq_len=1024, batch_size=64, lr=2e-3, warmup_steps=300, eval_every=250,
                   steps_per_call=10, schedule="wsd"),
    "draft": dict(seq_len=1024, batch_size=64, lr=3e-3, warmup_steps=200, eval_every=250,
                  steps_per_call=10, schedule="cosine"),
    "toy": dict(seq_len=64, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=10,
                steps_per_call=5, schedule="cosine"),
}


def hf_config(arch: dict, vocab_size: int, max_positions: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **arch,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def make_optimizer(weight_decay: float):
    def build(learning_rate):
        # No decay on norms (1-D weights): decaying them toward 0 fights the normalisation.
        decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                       mask=decay_mask))
    return optax.inject_hyperparams(build)(learning_rate=0.0)


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float,
          schedule: str = "cosine", decay_frac: float = 0.3) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "wsd":
        decay = max(1, round(decay_frac * (total - warmup)))
        progress = min(1.0, max(0, step - (total - decay)) / decay)
        return peak * (1 - (1 - final_frac) * progress)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def early_decay_total(step: int, warmup: int, decay_frac: float, multiple: int) -> int:
    """The schedule length whose WSD decay starts at `step` (a multiple of `multiple`)."""
    total = warmup + math.ceil((step - warmup) / (1 - decay_frac))
    return -(-total // multiple) * multiple


def build_steps(cfg, optimizer, compute_dtype, kernels, teacher_cfg=None, distill_weight: float = 0.0):
    """-> (train_steps, eval_loss_sum). train_steps(params, opt_state, batches [S, B, L + 1],
    lrs f32[S], teacher_params) runs S optimizer steps in one call (params and state donated) and
    returns (params, opt_state, losses f32[S], grad norms f32[S]). With `teacher_cfg` the loss also
    matches the teacher's next-token distribution."""
    forward = lambda params, tokens: train_forward(params, cfg, tokens, kernels)

    def loss_fn(params, batch, teacher_params):
        compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = forward(compute, batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        if teacher_cfg is None:
            return loss
        t_logits = train_forward(teacher_params, teacher_cfg, batch[:, :-1], kernels)
        soft = optax.softmax_cross_entropy(logits.astype(jnp.float32),
                                           jax.nn.softmax(t_logits.astype(jnp.float32))).mean()
        return (1 - distill_weight) * loss + distill_weight * soft

    def one_step(carry, xs, teacher_params):
        params, opt_state = carry
        batch, lr = xs
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, teacher_params)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, optax.tree.norm(grads))

    def train_steps(params, opt_state, batches, lrs, teacher_params=None):
        (params, opt_state), (losses, gnorms) = jax.lax.scan(
            lambda c, xs: one_step(c, xs, teacher_params), (params, opt_state), (batches, lrs))
        return params, opt_state, losses, gnorms

    @jax.jit
    def eval_loss_sum(params, batch, row_weight):
        """Sum of token cross-entropies over the rows with weight 1 (0 marks padding rows)."""
        compute = jax.tree.map(lambda p: p.astype(compute_dtype), params)
        logits = forward(compute, batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return (ce.sum(axis=-1) * row_weight).sum()

    return jax.jit(train_steps, donate_argnums=(0, 1)), eval_loss_sum


def evaluate(eval_loss_sum, params, windows: np.ndarray, batch_size: int) -> float:
    """Mean held-out cross-entropy (nats/token) over all windows. The last batch is padded to the
    compiled shape with weight-0 rows."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        n = len(chunk)
        weight = np.zeros(batch_size, np.float32)
        weight[:n] = 1.0
        if n < batch_size:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - n, axis=0)])
        total += float(eval_loss_sum(params, chunk, weight))
        count += n * (windows.shape[1] - 1)
    return total / count


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("target", "draft"), default="target")
    p.add_argument("--toy", action="store_true", help="tiny model and shapes for a CPU smoke run")
    p.add_argument("--data", type=Path, default=REPO / "build" / "demo_corpus",
                   help="directory with train.npy, heldout.npy and tokenizer/ (build_corpus.py)")
    p.add_argument("--out", type=Path, required=True, help="HF-format output directory")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--steps-per-call", type=int, help="optimizer steps per jitted call (lax.scan)")
    p.add_argument("--schedule", choices=("wsd", "cosine"))
    p.add_argument("--decay-frac", type=float, default=0.3,
                   help="wsd: fraction of the post-warmup steps spent decaying")
    p.add_argument("--patience", type=int, default=4,
                   help="wsd: start the decay early once this many evals in a row found no new "
                        "best held-out loss (0: never)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows per eval")
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--final-lr-frac", type=float, default=0.1,
                   help="learning rate at the end of the schedule, as a fraction of the peak")
    p.add_argument("--attention", choices=("auto", "cudnn", "xla", "reference"), default="auto",
                   help="dense attention in training: auto = cudnn on a GPU (xla if cuDNN's "
                        "kernel does not compile), the jnp reference elsewhere")
    p.add_argument("--extra", action="store_true",
                   help="also train on extra_train.npy (third-party code: it helps the distilled "
                        "draft; the target does better on the stdlib alone: checkpoints/README.md)")
    p.add_argument("--stdlib-repeat", type=int, default=2,
                   help="with --extra: copies of each stdlib document per epoch (extra code: one)")
    p.add_argument("--teacher", type=Path, help="HF model directory to distil from (same tokenizer)")
    p.add_argument("--distill-weight", type=float, default=0.9,
                   help="with --teacher: weight of the teacher cross-entropy in the loss")
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--max-seconds", type=float, default=0,
                   help="wall-clock budget for the whole run, saving included (0: no limit)")
    p.add_argument("--state", type=Path, help="where a run cut short by --max-seconds saves its "
                                              "full training state (orbax)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --state")
    p.add_argument("--job-steps", type=int, default=0,
                   help="stop (saving --state) after this many steps of this job (0: no limit)")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = "toy" if args.toy else args.model
    for key, value in HPARAMS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compute_dtype is None:
        args.compute_dtype = "float32" if args.toy else "bfloat16"
    for name in ("seq_len", "batch_size", "warmup_steps", "eval_every", "max_steps", "stdlib_repeat",
                 "steps_per_call", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.resume and args.state is None:
        p.error("--resume needs --state")
    args.preset = preset
    return args


def training_kernels(choice: str):
    """(the kernel table, its name in the record) of --attention `choice`."""
    if choice == "auto":
        choice = "cudnn" if jax.default_backend() == "gpu" else "reference"
    if choice == "reference":
        return REFERENCE_KERNELS, "reference"
    return with_fused_dense(REFERENCE_KERNELS, choice), f"reference+dense_{choice}"


def compile_steps(args, cfg, optimizer, compute_dtype, t_cfg, example):
    """The jitted steps, compiled for `example`'s shapes; with --attention auto, falls back from
    cuDNN to XLA's attention if cuDNN's kernel does not compile here."""
    choices = [args.attention] if args.attention != "auto" or jax.default_backend() != "gpu" \
        else ["cudnn", "xla"]
    for i, choice in enumerate(choices):
        kernels, name = training_kernels(choice)
        train_steps, eval_loss_sum = build_steps(cfg, optimizer, compute_dtype, kernels, t_cfg,
                                                 args.distill_weight)
        try:
            return train_steps.lower(*example).compile(), eval_loss_sum, name
        except Exception as e:  # any compile failure: try the next attention
            if i + 1 == len(choices):
                raise
            print(f"attention {choice} does not compile here ({type(e).__name__}: {e}); "
                  f"trying {choices[i + 1]}", flush=True)


def load_corpus(args):
    for f in ("train.npy", "heldout.npy", *(f"tokenizer/{n}" for n in TOKENIZER_FILES)):
        if not (args.data / f).is_file():
            raise SystemExit(f"--data {args.data}: missing {f} (run checkpoints/build_corpus.py)")
    docs = split_documents(np.load(args.data / "train.npy"))
    if args.extra:
        docs = docs * args.stdlib_repeat + split_documents(np.load(args.data / "extra_train.npy"))
    windows = heldout_windows(np.load(args.data / "heldout.npy"), args.seq_len, args.eval_windows)
    vocab = json.loads((args.data / "tokenizer" / "tokenizer.json").read_text())
    return docs, windows, len(vocab["model"]["vocab"])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.max_seconds if args.max_seconds > 0 else math.inf
    docs, windows, vocab_size = load_corpus(args)
    data = PackedBatches(docs, args.seq_len, args.batch_size, args.seed)
    epoch_tokens = sum(d.size for d in docs)
    raw_cfg = hf_config(ARCHITECTURES[args.preset], vocab_size, args.seq_len)
    cfg = config_from_dict(raw_cfg)
    compute_dtype = jnp.dtype(args.compute_dtype)
    optimizer = make_optimizer(args.weight_decay)
    params = init_params(cfg, jax.random.key(args.seed), jnp.float32)
    # Committed to the device, as every step's outputs are (a compiled step takes no other).
    params, opt_state = jax.device_put((params, optimizer.init(params)), jax.devices()[0])
    t_cfg = t_params = None
    if args.teacher is not None:
        t_cfg = load_config(args.teacher)
        t_params = jax.device_put(load_params(args.teacher, t_cfg, compute_dtype, progress=False),
                                  jax.devices()[0])
    S = args.steps_per_call
    tokens_per_step = args.batch_size * args.seq_len
    total_steps = max(S, args.max_steps // S * S)  # whole calls: one compiled shape
    log: dict = {"losses": [], "evals": []}
    step, best_loss, best_step, best, since_best = 0, math.inf, -1, None, 0
    if args.resume:
        params, opt_state, best, saved = restore_state(args.state, params, opt_state)
        step, total_steps, best_loss, best_step, since_best, log = (saved[k] for k in (
            "step", "total_steps", "best_loss", "best_step", "since_best", "log"))
        print(f"resumed at step {step} of {total_steps} (best held-out loss {best_loss:.4f} "
              f"at step {best_step})", flush=True)
    t_compile = time.perf_counter()
    example = (params, opt_state, data.batches(0, S), np.zeros(S, np.float32), t_params)
    train_steps, eval_loss_sum, attention = compile_steps(args, cfg, optimizer, compute_dtype, t_cfg,
                                                          example)
    evaluate(eval_loss_sum, params, windows[:args.eval_batch_size], args.eval_batch_size)  # compiles
    log["compile_seconds"] = time.perf_counter() - t_compile
    print(f"{args.preset}: {cfg.num_params():,} params, {epoch_tokens:,} training tokens per epoch "
          f"(extra code: {args.extra}), teacher {args.teacher}, {len(windows)} held-out windows "
          f"of {args.seq_len}, {tokens_per_step:,} tokens/step, {S} steps/call, attention "
          f"{attention}, compiled in {log['compile_seconds']:.1f} s, devices {jax.devices()}",
          flush=True)
    t_eval = time.perf_counter()
    if not args.resume:
        initial = evaluate(eval_loss_sum, params, windows, args.eval_batch_size)
        log["evals"].append({"step": 0, "heldout_loss": initial, "heldout_ppl": math.exp(initial)})
    eval_seconds = time.perf_counter() - t_eval
    eval_total = 0.0
    timed_from = pending = None
    bar = tqdm(total=total_steps, initial=step, desc=f"train {args.preset}", unit="step",
               mininterval=5.0)
    first_step = step
    t_train = time.perf_counter()

    def record_losses(pending) -> None:
        at, losses, gnorms, lrs = pending
        losses, gnorms = np.asarray(losses), np.asarray(gnorms)
        if not np.isfinite(losses).all():
            raise SystemExit(f"step {at}: loss is {losses.tolist()}; lower --lr (now {args.lr})")
        for i in range(len(losses)):
            if (at + i + 1) % 10 == 0:
                log["losses"].append({"step": at + i + 1, "loss": float(losses[i]),
                                      "lr": float(lrs[i]), "grad_norm": float(gnorms[i])})
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lrs[-1]:.2e}")

    while step < total_steps:
        lrs = np.asarray([lr_at(s, total_steps, args.lr, args.warmup_steps, args.final_lr_frac,
                                args.schedule, args.decay_frac) for s in range(step, step + S)],
                         np.float32)
        params, opt_state, losses, gnorms = train_steps(params, opt_state, data.batches(step, S),
                                                        lrs, t_params)
        if pending is not None:  # the previous call's losses: read while this call runs
            record_losses(pending)
        pending = (step, losses, gnorms, lrs)
        step += S
        bar.update(S)
        if step - first_step >= TIMED_FROM_STEP and timed_from is None:
            losses.block_until_ready()
            timed_from = (step, time.perf_counter())
        if step - first_step >= PLAN_AT_STEP and "planned" not in log and math.isfinite(deadline) \
                and not args.resume:
            losses.block_until_ready()
            sec_per_step = (time.perf_counter() - timed_from[1]) / (step - timed_from[0])
            # Reserve: the final eval + saving (~3 evals' worth + 5 s) and the periodic evals.
            eval_est = max(eval_seconds, 0.5)
            left = deadline - time.perf_counter() - 3 * eval_est - 5.0
            fit = int(left / (sec_per_step + eval_est / args.eval_every))
            total_steps = max(step, min(args.max_steps, step + fit) // S * S)
            bar.total = total_steps
            log["planned"] = {"sec_per_step": sec_per_step, "total_steps": total_steps,
                              "tokens_per_second": tokens_per_step / sec_per_step}
        out_of_time = step < total_steps and (time.perf_counter() > deadline or (
            args.job_steps and step - first_step >= args.job_steps))
        if step // args.eval_every > (step - S) // args.eval_every or step == total_steps or out_of_time:
            record_losses(pending)
            pending = None
            t_eval = time.perf_counter()
            heldout = evaluate(eval_loss_sum, params, windows, args.eval_batch_size)
            eval_seconds = time.perf_counter() - t_eval
            eval_total += eval_seconds
            log["evals"].append({"step": step, "heldout_loss": heldout, "heldout_ppl": math.exp(heldout)})
            tqdm.write(f"step {step}: held-out loss {heldout:.4f} (ppl {math.exp(heldout):.2f})")
            since_best += 1
            if heldout < best_loss:  # bf16: what the eval computed with and what ships
                best_loss, best_step, since_best = heldout, step, 0
                best = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
            early = early_decay_total(step, args.warmup_steps, args.decay_frac, S)
            if (args.schedule == "wsd" and args.patience and since_best >= args.patience
                    and step > args.warmup_steps and early < total_steps):
                # Held-out loss stopped improving at the peak rate (repeated data starts to be
                # memorised): anneal now rather than keep training on it.
                tqdm.write(f"step {step}: no better held-out loss in {since_best} evals; "
                           f"decaying now, over to step {early} (was {total_steps})")
                log["early_decay"] = {"at_step": step, "total_steps": early, "was": total_steps}
                total_steps = bar.total = early
        if out_of_time:
            tqdm.write(f"out of this job's time or steps at step {step} of {total_steps}; stopping")
            break
    if pending is not None:
        record_losses(pending)
    bar.close()
    train_seconds = time.perf_counter() - t_train
    done = step >= total_steps
    if not done and args.state is not None:
        save_state(args.state, params, opt_state, best, dict(
            step=step, total_steps=total_steps, best_loss=best_loss, best_step=best_step,
            since_best=since_best, log=log))

    save_model_dir(args, raw_cfg, cfg, best)
    trained = step - first_step
    steady = max(train_seconds - eval_total, 1e-9)
    tok_s = trained * tokens_per_step / steady
    summary = {
        "model": args.preset,
        "params": cfg.num_params(),
        "config": raw_cfg,
        "hparams": {k: str(v) if isinstance(v, Path) else v for k, v in (
            (k, getattr(args, k)) for k in ("seq_len", "batch_size", "lr", "warmup_steps", "weight_decay",
                                            "schedule", "decay_frac", "patience", "final_lr_frac",
                                            "steps_per_call",
                                            "extra", "stdlib_repeat", "teacher", "distill_weight",
                                            "eval_windows", "seed", "compute_dtype", "max_steps",
                                            "max_seconds"))},
        "attention": attention,
        "epoch_tokens": epoch_tokens,
        "steps": step,
        "schedule_steps": total_steps,
        "done": done,
        "tokens_seen": step * tokens_per_step,
        "epochs": data.epochs(step),
        "train_seconds": train_seconds,
        "eval_seconds": eval_total,
        # Throughput of this job's training calls (evals excluded; the first call's compile is not
        # in train_seconds: the steps are compiled ahead of the loop).
        "tokens_per_second": tok_s,
        "mfu_6n": 6 * cfg.num_params() * tok_s / H200_BF16_PEAK,
        "saved_step": best_step,
        "heldout_loss": best_loss,
        "heldout_ppl": math.exp(best_loss),
        "heldout_tokens": int(windows.size - len(windows)),
        "device": str(jax.devices()[0].device_kind),
        **log,
    }
    (args.out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{args.preset}: {step} steps, {summary['tokens_seen']:,} tokens ({summary['epochs']:.2f} epochs) "
          f"in {train_seconds:.1f} s ({tok_s:,.0f} tok/s, evals {eval_total:.1f} s); saved step "
          f"{best_step}: held-out loss {best_loss:.4f}, ppl {math.exp(best_loss):.2f} -> {args.out}"
          f"{'' if done else f'; NOT done: resume with --state {args.state} --resume'}", flush=True)
    return summary


def save_model_dir(args, raw_cfg: dict, cfg, params) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    bf16 = jax.tree.map(lambda p: np.asarray(p).astype(jnp.bfloat16), params)
    save_safetensors(bf16, cfg, args.out)
    (args.out / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:  # generation_config.json (eos ids) comes with the tokenizer
        shutil.copyfile(args.data / "tokenizer" / name, args.out / name)


if __name__ == "__main__":
    main()
