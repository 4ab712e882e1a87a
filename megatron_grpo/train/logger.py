"""Run outputs on the main rank: metrics.jsonl, completions.jsonl (eval_completions.jsonl
for evaluations), a progress bar, tensorboard (when asked) and, at the end, a reward-curve
PNG."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

from tqdm import tqdm

from .. import console


def _clean(value):
    value = float(value)
    return value if math.isfinite(value) else None     # JSON has no NaN


def _truncate_after(path: str, step: int) -> None:
    if not os.path.isfile(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


def _has_step(path: str, step: int) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return any(line.strip() and json.loads(line).get("step") == step for line in f)


class RunLogger:
    def __init__(self, output_dir: str, total_steps: int, *, report_to=(), logging_steps=1,
                 log_completions=False, enabled=True, start_step=0, last_row=None,
                 wandb_project=None,
                 wandb_exp_name=None, swanlab_project=None, swanlab_exp_name=None):
        self.enabled = enabled
        self.output_dir = output_dir
        self.logging_steps = max(1, logging_steps)
        self.log_completions = log_completions
        self.tb = None
        self.bar = None
        self.sinks = []
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.completions_path = os.path.join(output_dir, "completions.jsonl")
        # On resume, rows of steps after the checkpoint were lost with the crash and
        # will be redone: drop them so that every step appears once.
        for path in (self.metrics_path, self.completions_path,
                     os.path.join(output_dir, "eval_completions.jsonl")):
            _truncate_after(path, start_step)
        if last_row is not None and start_step and not _has_step(self.metrics_path, start_step):
            # the checkpoint's own step, killed between its save and its row: the row as
            # the checkpoint kept it (without the save's memory/save)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"step": start_step, **{
                    k: _clean(v) for k, v in sorted(last_row.items())}}) + "\n")
        if "tensorboard" in (report_to or ()):
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "runs"))
        # wandb / swanlab: the same scalars. Project: --wandb_project / --swanlab_project
        # (ms-swift's default megatron-swift); run name: --*_exp_name, else the output
        # folder's name.
        self.sinks = []
        run_name = os.path.basename(os.path.normpath(output_dir))
        if "wandb" in (report_to or ()):
            import wandb

            wandb.init(project=wandb_project or "megatron-swift",
                       name=wandb_exp_name or run_name, dir=output_dir)
            self.sinks.append(wandb)
        if "swanlab" in (report_to or ()):
            import swanlab

            swanlab.init(project=swanlab_project or "megatron-swift",
                         experiment_name=swanlab_exp_name or run_name, logdir=output_dir)
            self.sinks.append(swanlab)
        # On a terminal one progress bar, its postfix the step's main metrics; elsewhere
        # (a pipe, a file, a job's log) one line per logging_steps instead of its redraws.
        stream = console.out()
        self.total_steps = total_steps
        if stream.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, desc="GRPO", unit="step",
                            dynamic_ncols=True, file=stream)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self.tb.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=step)
        short = {k: row.get(k) for k in ("reward", "loss", "kl", "grad_norm",
                                         "completions/mean_length") if row.get(k) is not None}
        if self.bar is not None:
            self.bar.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in short.items()},
                                 refresh=False)
            self.bar.update(1)
        elif step % self.logging_steps == 0 or step == self.total_steps:
            line = ", ".join(f"{k}={v:.4g}" for k, v in short.items())
            if row.get("memory/peak") is not None:   # the step's largest phase, any rank
                line += f", memory/peak={row['memory/peak']:.2f} GiB"
            console.say(f"step {step}/{self.total_steps}: " + line)

    def completions(self, step: int, prompts, texts, rewards, reward_names, extra=None,
                    file=None) -> None:
        """One row per completion (with --log_completions); `file`: another file of
        output_dir than completions.jsonl (evaluations: eval_completions.jsonl)."""
        if not (self.enabled and self.log_completions):
            return
        path = os.path.join(self.output_dir, file) if file else self.completions_path
        with open(path, "a") as f:
            for i, (p, c) in enumerate(zip(prompts, texts)):
                row = {"step": step, "prompt": p, "completion": c}
                row.update({name: _clean(rewards[i][j]) for j, name in enumerate(reward_names)})
                if extra:
                    row.update({k: v[i] for k, v in extra.items()})
                f.write(json.dumps(row) + "\n")

    def close(self) -> Optional[str]:
        """Close the bar and writers; plot reward (and loss) per step. Returns the PNG path."""
        if not self.enabled:
            return None
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.finish()
        return plot_metrics(self.metrics_path, os.path.join(self.output_dir, "reward_curve.png"))


def plot_metrics(metrics_path: str, png_path: str, keys=("reward", "eval/reward", "loss", "kl",
                                                         "teacher_kl", "completions/mean_length")):
    if not os.path.isfile(metrics_path):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    keys = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True)
    axes = [axes] if len(keys) == 1 else axes
    for ax, k in zip(axes, keys):
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1)
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    axes[0].set_title("GRPO training")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
