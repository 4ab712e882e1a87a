"""The CPU quickstart behind `bash scripts/quickstart.sh`.

Builds a tiny Qwen2 checkpoint (random weights, locally trained tokenizer; the tiny
Qwen3-MoE instead for a config that names it, configs/quickstart_moe_cpu.yaml), then runs
`NPROC_PER_NODE=2 megatron rlhf --config configs/quickstart_cpu.yaml`: GRPO with a
DP=2 Megatron-Core model (distributed optimizer) and a colocated vLLM engine in each of 2 CPU processes, rewarding
digits in the completions (examples/plugins/digits_reward.py). It ends by printing
the reward of the first and last steps; the run's folder holds metrics.jsonl,
completions.jsonl, reward_curve.png, checkpoints and the final HF model.

`--smoke` (and any checkout without the trainer) runs the earlier smoke job instead:
a TP=2 Megatron forward on 2 gloo processes and a vLLM generate.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_grpo.config.hf_model import BF16_CPU_FLAGS, cpu_has_bf16  # noqa: E402


def step(msg: str) -> None:
    print(f"[quickstart] {msg}", flush=True)


def megatron_forward(model_dir: str) -> None:
    """One rank of the TP=2 forward (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    world = int(os.environ["WORLD_SIZE"])
    init_parallel(ParallelDims(world_size=world, tp=world))
    config, args = build_transformer_config(model_dir, tp=world)
    (model,) = build_model(config, args)
    try:  # the bridge loads the HF weights when it is installed
        from bridge import load_hf_weights

        load_hf_weights([model], config, args, model_dir)
        source = "HF weights via the bridge"
    except ImportError:
        source = "random init (bridge not available)"
    ids = torch.arange(16).unsqueeze(0) % args.vocab_size
    pos = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids, pos, None)  # [b, s, V/tp]
    if dist.get_rank() == 0:
        print(f"[quickstart] Megatron TP={world} forward ok ({source}): logits shard [b, s, V/tp] "
              f"{tuple(logits.shape)}, mean {logits.float().mean().item():.4f}", flush=True)
    from megatron_grpo.platform import destroy_parallel

    destroy_parallel()


def vllm_generate(model_dir: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from megatron_grpo.rollout.kv_cache import kv_cache_engine_kwargs

    # The KV cache in bytes for this one sequence (on CPU; GPU: vLLM's default fraction).
    kv = kv_cache_engine_kwargs(model_dir, on_cpu=current_platform.is_cpu(), sequences=1,
                                max_model_len=256, dtype="float32")
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              **kv)
    out = llm.generate(["<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"],
                       SamplingParams(max_tokens=16, temperature=1.0, seed=0))
    text = out[0].outputs[0].text
    print(f"[quickstart] vLLM generate ok: {len(out[0].outputs[0].token_ids)} tokens: {text!r}",
          flush=True)


# The tiny checkpoints the shipped configs name (their `model:`), by folder name. hidden 128
# / 4 heads: vLLM's CPU attention needs head_dim >= 32.
TINY_MODELS = {
    "tiny-qwen2": dict(family="qwen2", intermediate_size=256),
    # 4 experts of 128, top-2: the active MLP width of tiny-qwen2's 256.
    "tiny-qwen3-moe": dict(family="qwen3_moe", head_dim=32,
                           moe=dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=128)),
}


def build_tiny(out_dir: str, name: str = "tiny-qwen2") -> str:
    from tools.make_tiny_model import make_tiny_model

    model_dir = os.path.join(out_dir, name)
    spec = TINY_MODELS[name]
    step(f"building a tiny {spec['family']} checkpoint (random weights, local tokenizer) in "
         f"{model_dir}")
    make_tiny_model(model_dir, num_layers=2, hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=999, **spec)
    return model_dir


def _config(config_path: str) -> dict:
    import yaml

    with open(config_path) as f:
        return yaml.safe_load(f) or {}


def config_bf16(config_path: str) -> bool:
    """The `bf16:` of a shipped config (flat or under `training:`), False when it sets none."""
    cfg = _config(config_path)
    training = cfg.get("training") if isinstance(cfg.get("training"), dict) else {}
    return bool(cfg.get("bf16", training.get("bf16", False)))


def dtype_args(config_path: str, cpuinfo: Optional[str] = None) -> list:
    """Extra flags for this CPU: a config in bfloat16 runs in float32 (`--bf16 false`) on a
    CPU without bfloat16 instructions, where bf16 would be the slower of the two."""
    if config_bf16(config_path) and not cpu_has_bf16(cpuinfo):
        return ["--bf16", "false"]
    return []


def reward_model_args(config_path: str, out_dir: str, policy_dir: str) -> list:
    """A config whose reward model is the tiny digits one (configs/quickstart_rm_cpu.yaml):
    it is built in out_dir with the policy's tokenizer, and passed as --reward_model."""
    cfg = _config(config_path)
    reward = cfg.get("reward") if isinstance(cfg.get("reward"), dict) else cfg
    names = [os.path.basename(str(p).rstrip("/")) for p in reward.get("reward_model") or []]
    if "tiny-digits-rm" not in names:
        return []
    from tools.make_tiny_model import make_digit_reward_model

    path = os.path.join(out_dir, "tiny-digits-rm")
    step(f"building a tiny reward model that scores digits in {path}")
    return ["--reward_model", str(make_digit_reward_model(path, policy_dir))]


def config_model_name(config_path: str) -> str:
    """The tiny model a shipped config trains: the folder name of its `model:` (flat or under
    `model:`), tiny-qwen2 for a config that names none of TINY_MODELS."""
    cfg = _config(config_path)
    model = cfg.get("model")
    if isinstance(model, dict):
        model = model.get("model")
    name = os.path.basename(str(model or "").rstrip("/"))
    return name if name in TINY_MODELS else "tiny-qwen2"


def smoke(out_dir: str) -> None:

    t0 = time.time()
    model_dir = build_tiny(out_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    step("Megatron-Core TP=2 forward on 2 CPU processes (gloo)")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    "--standalone",
                    os.path.abspath(__file__), "--_forward", model_dir], env=env, check=True)
    step("vLLM generate (CPU engine, float32)")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--_generate", model_dir],
                   env=env, check=True)
    step(f"smoke job done in {time.time() - t0:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "quickstart"))
    p.add_argument("--smoke", action="store_true", help="run the smoke job instead of GRPO")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart_cpu.yaml"),
                   help="the run's YAML (configs/quickstart_lora_cpu.yaml: the LoRA variant, "
                        "configs/quickstart_moe_cpu.yaml: mixture of experts, EP=2)")
    p.add_argument("--_forward", help=argparse.SUPPRESS)
    p.add_argument("--_generate", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._forward:
        return megatron_forward(a._forward)
    if a._generate:
        return vllm_generate(a._generate)
    import importlib.util

    if a.smoke or importlib.util.find_spec("megatron_grpo.trainer") is None:
        return smoke(a.output_dir)
    cfg = os.path.abspath(a.config)
    model_dir = build_tiny(a.output_dir, config_model_name(cfg))
    extra = reward_model_args(cfg, a.output_dir, model_dir)
    name = os.path.splitext(os.path.basename(cfg))[0]
    out = os.path.join(a.output_dir, {"quickstart_cpu": "grpo",
                                      "quickstart_lora_cpu": "grpo_lora",
                                      "quickstart_moe_cpu": "grpo_moe",
                                      "quickstart_rm_cpu": "grpo_rm"}.get(name, name))
    if os.path.isdir(out):   # a demo starts fresh (megatron rlhf itself would resume)
        import shutil

        shutil.rmtree(out)
    if dtype_args(cfg):
        extra += dtype_args(cfg)
        step("this CPU has no bfloat16 instructions (none of " + ", ".join(BF16_CPU_FLAGS) +
             " in /proc/cpuinfo): training and sampling in float32 instead (--bf16 false)")
    step(" ".join(["GRPO on 2 CPU processes: NPROC_PER_NODE=2 megatron rlhf --config", cfg, *extra]))
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    t0 = time.time()
    rc = subprocess.call([sys.executable, "-m", "megatron_grpo.cli", "rlhf", "--config", cfg,
                          "--model", model_dir, "--output_dir", out, *extra], env=env, cwd=ROOT)
    if rc != 0:
        sys.exit(rc)
    report(out, time.time() - t0)


def report(out_dir: str, seconds: float) -> None:
    """Print the reward at the start and the end of the run: the quickstart's bar is a
    mean reward of the last 10 steps at least 0.3 above that of the first 10."""
    import json

    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    n = min(10, len(rows))
    first = sum(r["reward"] for r in rows[:n]) / n
    last = sum(r["reward"] for r in rows[-n:]) / n
    verdict = "met" if last - first >= 0.3 else "NOT met"
    step(f"{len(rows)} steps in {seconds:.0f} s; mean reward of the first {n} steps {first:.4f}, "
         f"of the last {n} {last:.4f} (+{last - first:.4f}; bar +0.3: {verdict})")
    step(f"metrics: {out_dir}/metrics.jsonl, curve: {out_dir}/reward_curve.png, "
         f"final model: {out_dir}/final_hf")


if __name__ == "__main__":
    main()
