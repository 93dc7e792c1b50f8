"""The record of a demo retraining (`train_demo_and_eagle_on_h200.sh`): target, draft and EAGLE-3
head, from the training logs in a checkpoints directory, as benchmarks/results/train_demo_<gpu>.json
(`results_io`); with matplotlib, also the learning curves as train_demo_<gpu>.png.

    python -m checkpoints.demo_record --checkpoints DIR [--save DIR] [--plot-only]

Throughput: trained tokens per second of the training calls (evals excluded); MFU counts
6 x parameters FLOPs per token against one H200's dense bf16 peak (989 TF/s) -- attention's
6 x layers x hidden x seq_len / 2 more (causal) is left out, as in the usual 6N convention.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxinfer.bench import results_io

# The run the retraining replaces (checkpoints/README.md): 32 x 1024 tokens per step, f32
# reference attention, one dispatch per step, grain input pipeline.
PREVIOUS = {"previous_target_ppl": 7.59, "previous_target_tokens": 76_000_000,
            "previous_target_tok_s": 478_000}


def read_log(directory: Path) -> dict | None:
    path = directory / "training_log.json"
    return json.loads(path.read_text()) if path.is_file() else None


def metrics(ckpt: Path) -> dict:
    m: dict = dict(PREVIOUS)
    target, draft, eagle = (read_log(ckpt / d) for d in ("demo-target", "demo-draft", "demo-eagle3"))
    if target is not None:
        m.update(demo_target_ppl=round(target["heldout_ppl"], 3), target_params=target["params"],
                 target_tokens_trained=target["tokens_seen"], target_epochs=round(target["epochs"], 2),
                 target_steps=target["steps"], target_schedule_steps=target["schedule_steps"],
                 target_done=target.get("done", True), target_saved_step=target["saved_step"],
                 target_tok_s=round(target["tokens_per_second"]),
                 target_mfu_6n=round(target.get("mfu_6n", 0.0), 4),
                 target_ms_per_step=round(1e3 * target.get("planned", {}).get("sec_per_step", 0.0), 2),
                 target_early_decay=target.get("early_decay"),
                 target_train_s=round(target["train_seconds"], 1),
                 target_compile_s=round(target["compile_seconds"], 1),
                 target_attention=target.get("attention"),
                 target_heldout_ppl_curve={e["step"]: round(e["heldout_ppl"], 3)
                                           for e in target["evals"]})
    if draft is not None:
        m.update(draft_ppl=round(draft["heldout_ppl"], 3), draft_params=draft["params"],
                 draft_tokens_trained=draft["tokens_seen"], draft_tok_s=round(draft["tokens_per_second"]),
                 draft_teacher=draft["hparams"].get("teacher"))
    if eagle is not None and eagle.get("eval"):
        last = eagle["eval"][-1]
        # Step j's agreement is measured on the target's own chain (TTT), so it estimates the
        # chance the j-th proposal is accepted given the ones before it were.
        est, run = 1.0, 1.0
        for a in last["agreement"]:
            run *= a
            est += run
        m.update(eagle_steps=last["step"], eagle_heldout_ttt_loss=round(last["loss"], 4),
                 eagle_heldout_agreement=last["agreement"],
                 eagle_est_mean_accepted_len=round(est, 3),
                 eagle_train_s=round(sum(j["seconds"] for j in eagle["jobs"]), 1))
    return m


def plot(ckpt: Path, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the `bench` extra): no learning-curve plot")
        return False
    target, eagle = read_log(ckpt / "demo-target"), read_log(ckpt / "demo-eagle3")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    if target is not None:
        left.plot([x["step"] for x in target["losses"]], [x["loss"] for x in target["losses"]],
                  alpha=0.5, label="train loss")
        ev = [e for e in target["evals"] if e["step"] > 0]
        left.plot([e["step"] for e in ev], [e["heldout_loss"] for e in ev], "o-", ms=3,
                  label="held-out loss")
        left.axhline(1.9169, ls=":", c="gray", label="ppl 6.8")
        left.set_yscale("log")  # 8.3 (ln 4096) at the start, ~1.9 at the goal: both visible
        left.set_title(f"demo target ({target['params'] / 1e6:.1f} M params), loss (nats)")
        left.set_xlabel("step")
        left.legend()
        left.grid(alpha=0.3)
    if eagle is not None:
        right.plot(*zip(*eagle["train"]), alpha=0.5, label="train TTT loss")
        right.plot([e["step"] for e in eagle["eval"]], [e["loss"] for e in eagle["eval"]], "o-",
                   ms=3, label="held-out TTT loss")
        right.set_title("EAGLE-3 head")
        right.set_xlabel("step")
        right.legend()
        right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", type=Path, default=Path("checkpoints"),
                   help="directory holding demo-target/, demo-draft/, demo-eagle3/")
    p.add_argument("--plot-only", action="store_true", help="only (re)draw the PNG")
    results_io.add_save_arg(p, "train_demo_<gpu>")
    a = p.parse_args(argv)
    import jax  # results_io.machine() reports the accelerator of an imported jax only
    name = a.name or f"train_demo_{results_io.device_slug()}"
    out = Path(a.save or results_io.RESULTS_DIR)
    out.mkdir(parents=True, exist_ok=True)
    plotted = plot(a.checkpoints, out / f"{name}.png")
    if a.plot_only:
        return
    results_io.save(out, name, metrics=metrics(a.checkpoints),
                    config={"checkpoints": str(a.checkpoints), "peak_bf16_flops": 989e12,
                            "device": jax.devices()[0].device_kind,
                            "plot": f"{name}.png" if plotted else None,
                            "stages": "target (train_demo.py), draft (distilled from the new "
                                      "target), EAGLE-3 head (jaxinfer train-eagle)"})


if __name__ == "__main__":
    main()
