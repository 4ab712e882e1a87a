"""Options of `megatron rollout`, the standalone vLLM server of server mode.

    megatron rollout --model DIR --vllm_tensor_parallel_size 2 --vllm_data_parallel_size 1 \
        --host 127.0.0.1 --port 8000

The vLLM options share their names and defaults with `megatron rlhf`;
`--host`/`--port`/`--api_key` follow ms-swift's `swift rollout`, except that the
server binds 127.0.0.1 unless told otherwise.

Multi-turn: ms-swift's `swift rollout` may run the scheduler on the server
(`--multi_turn_scheduler`, `--max_turns`, `--use_gym_env`, `--gym_env`, plugins with
`--external_plugins`). Here the trainer runs it in server mode too (each turn of a
trajectory is its own request to this server, token ids in and out), so those flags
are refused by name with the command to move them to (TRAINER_SIDE).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from .errors import Problems
from .groups import (DataOptions, ModelOptions, RolloutOptions, TrainingOptions, check_choices,
                     opt, same_as)
from .parse import parse_command
from .validate import VLLM_LORA_RANKS, check_vision_options, check_vllm_memory, check_vllm_model

# ms-swift `swift rollout` flags that belong to the trainer here (module docstring).
TRAINER_SIDE = ("multi_turn_scheduler", "max_turns", "use_gym_env", "gym_env", "external_plugins")


@dataclass
class RolloutServerConfig:
    """The model, the vLLM engine and the HTTP endpoint of a rollout server."""
    model: Optional[str] = same_as(ModelOptions, "model", "Local Hugging Face model folder. "
                                                          "Required.")
    vllm_tensor_parallel_size: int = same_as(RolloutOptions, "vllm_tensor_parallel_size",
                                             "vLLM tensor parallel size of each engine.")
    vllm_data_parallel_size: int = same_as(RolloutOptions, "vllm_data_parallel_size",
                                           "Number of vLLM engines (data parallel).")
    vllm_gpu_memory_utilization: float = same_as(
        RolloutOptions, "vllm_gpu_memory_utilization", "Fraction of GPU memory vLLM may take. "
                                                       "Not used to size the KV cache on CPU.")
    vllm_kv_cache_memory: Optional[str] = same_as(
        RolloutOptions, "vllm_kv_cache_memory",
        "KV cache size per vLLM worker: bytes or a size such as 512MiB, 2GiB. None: on CPU "
        "computed for vllm_max_num_seqs (else 32) sequences of the max model length; on "
        "GPU from vllm_gpu_memory_utilization. kv_cache_memory_bytes in vllm_engine_kwargs "
        "or VLLM_CPU_KVCACHE_SPACE win.")
    vllm_max_model_len: Optional[int] = same_as(RolloutOptions, "vllm_max_model_len")
    vllm_enforce_eager: bool = same_as(RolloutOptions, "vllm_enforce_eager")
    vllm_enable_prefix_caching: bool = same_as(RolloutOptions, "vllm_enable_prefix_caching")
    vllm_max_num_seqs: Optional[int] = same_as(RolloutOptions, "vllm_max_num_seqs",
                                               "vLLM max concurrent sequences; None: vLLM's "
                                               "(256).")
    vllm_engine_kwargs: Optional[Dict[str, Any]] = same_as(RolloutOptions, "vllm_engine_kwargs")
    max_pixels: Optional[int] = same_as(
        DataOptions, "max_pixels", "Vision-language models: the most pixels an image keeps "
                                   "(vLLM's image processor); the trainer's --max_pixels. None: "
                                   "MAX_PIXELS (environment), else the model's.")
    vllm_limit_mm_per_prompt: Optional[Dict[str, int]] = same_as(
        RolloutOptions, "vllm_limit_mm_per_prompt",
        "Vision-language models: the most images per prompt, as JSON ('{\"image\": 2}').")
    host: str = opt("127.0.0.1", "Address to bind; 0.0.0.0 exposes the server to the network.")
    port: int = opt(8000, "Port to listen on.")
    api_key: Optional[str] = opt(None, "Shared token the trainer must send to update weights.")
    seed: int = same_as(TrainingOptions, "seed", "Sampling seed.")
    vllm_enable_lora: bool = same_as(
        RolloutOptions, "vllm_enable_lora", "Serve one LoRA adapter beside the base model, sent "
                                            "and replaced by the trainer's adapter-only sync (its "
                                            "--vllm_enable_lora true).")
    vllm_max_lora_rank: int = opt(16, "With vllm_enable_lora: the largest adapter rank vLLM "
                                      "reserves room for (1 8 16 32 64 128 256 320 512).")

    def __post_init__(self) -> None:
        check_choices(self)
        p = Problems()
        if p.require(bool(self.model), "--model is required: pass a local Hugging Face model folder"):
            p.require(os.path.isfile(os.path.join(self.model, "config.json")),
                      f"--model {self.model!r}: no config.json there (or no such folder). "
                      "Fix: pass a Hugging Face model folder (megatron-grpo does not download models)")
        for name in ("vllm_tensor_parallel_size", "vllm_data_parallel_size"):
            p.require(getattr(self, name) >= 1, f"--{name} {getattr(self, name)} must be >= 1")
        check_vllm_memory(self, p)
        check_vllm_model(self.model, self.vllm_max_model_len, p)
        check_vision_options(self.model, self.max_pixels, self.vllm_limit_mm_per_prompt, p)
        p.require(self.vllm_max_lora_rank in VLLM_LORA_RANKS,
                  f"--vllm_max_lora_rank {self.vllm_max_lora_rank} is not a rank vLLM can reserve; "
                  f"allowed: {' '.join(map(str, VLLM_LORA_RANKS))}")
        p.require(0 < self.port < 65536, f"--port {self.port} is not a valid port (1-65535)")
        p.raise_if_any()


def parse_rollout_args(argv: Optional[Sequence[str]] = None) -> RolloutServerConfig:
    """A validated RolloutServerConfig from flags (`--config file.yaml` read first); one
    ConfigError listing every problem otherwise."""
    return parse_command(RolloutServerConfig, list(sys.argv[1:] if argv is None else argv),
                         prog="megatron rollout", group="server", refuse=_trainer_side)


def _trainer_side(name: str, given: str) -> Optional[str]:
    """Where a TRAINER_SIDE flag goes instead (module docstring)."""
    if name not in TRAINER_SIDE:
        return None
    return (f"{given}: --{name} is not an option of `megatron rollout` (ms-swift's server-side "
            "scheduler): the trainer runs the multi-turn scheduler in server mode too, each turn "
            f"its own request to this server. Fix: pass {given} to `megatron rlhf ... "
            "--vllm_mode server` and start `megatron rollout` without it")
