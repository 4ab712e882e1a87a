"""The CPU quickstart behind `bash scripts/quickstart.sh`.

Until the GRPO trainer lands (issue 6) it runs a smoke job that exercises the real
stack end to end on this machine: it builds a tiny Qwen2 checkpoint, runs a TP=2
Megatron-Core forward on 2 gloo processes, and samples from the same checkpoint
with vLLM. When `megatron_grpo.trainer` exists it runs the GRPO quickstart config
instead; the command stays the same.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.05, seed=0)
    out = llm.generate(["<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"],
                       SamplingParams(max_tokens=16, temperature=1.0, seed=0))
    text = out[0].outputs[0].text
    print(f"[quickstart] vLLM generate ok: {len(out[0].outputs[0].token_ids)} tokens: {text!r}",
          flush=True)


def smoke(out_dir: str) -> None:
    from tools.make_tiny_model import make_tiny_model

    t0 = time.time()
    model_dir = os.path.join(out_dir, "tiny-qwen2")
    step(f"building a tiny Qwen2 checkpoint in {model_dir}")
    make_tiny_model(model_dir, family="qwen2", num_layers=2, hidden_size=128,
                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                    vocab_size=999)
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
    p.add_argument("--_forward", help=argparse.SUPPRESS)
    p.add_argument("--_generate", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._forward:
        return megatron_forward(a._forward)
    if a._generate:
        return vllm_generate(a._generate)
    import importlib.util

    if importlib.util.find_spec("megatron_grpo.trainer") is None:
        step("the GRPO trainer is not there yet: running the smoke job")
        return smoke(a.output_dir)
    cfg = os.path.join(ROOT, "configs", "quickstart_cpu.yaml")
    step(f"GRPO quickstart: NPROC_PER_NODE=2 megatron rlhf --config {cfg}")
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    sys.exit(subprocess.call([sys.executable, "-m", "megatron_grpo.cli", "rlhf", "--config", cfg,
                              "--output_dir", a.output_dir], env=env))


if __name__ == "__main__":
    main()
