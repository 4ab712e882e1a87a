"""Hugging Face `config.json` -> Megatron `TransformerConfig` plus the GPTModel arguments.

The config is read by transformers' own config class (config/hf_model.py `model_config`),
so that the published checkpoints' flat layout and what transformers writes today
(`text_config`, `rope_parameters`, `num_local_experts`) build the same model."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config.hf_model import ModelConfig, head_size, model_config
from .families import Family, detect_family
from .moe import moe_config_kwargs
from .te import use_transformer_engine

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; valid: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's convention: pad the vocab to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _rope_theta(hf: dict) -> float:
    # transformers 5 moved rope settings into `rope_parameters`. Qwen2-VL configs of
    # transformers 4 name multimodal rope `{"type": "mrope", "mrope_section": ...}`: the
    # default frequencies, split by section (mrope_section).
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for d in (params, scaling):
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ("default", None) and not (rope_type == "mrope"
                                                       and "mrope_section" in d):
            raise ValueError(f"rope type {rope_type!r} (config.json rope_scaling/rope_parameters)"
                             " is not supported yet; supported: default")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _mrope_section(hf: dict) -> list[int]:
    """A vision-language model's split of the rotary frequency pairs between the temporal,
    height and width position ids (sums to head_dim / 2)."""
    for d in (hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}):
        if d.get("mrope_section"):
            return [int(x) for x in d["mrope_section"]]
    raise ValueError("config.json of a vision-language model names no mrope_section "
                     "(text_config.rope_parameters or rope_scaling)")


@dataclass
class ModelArgs:
    """What GPTModel needs besides the TransformerConfig."""

    family: Family
    vocab_size: int            # the HF vocab (rows of embed_tokens)
    padded_vocab_size: int     # Megatron's rows, divisible by TP
    max_sequence_length: int
    rotary_base: float
    tie_word_embeddings: bool
    hf_config: dict            # the language view (hf_model.ModelConfig.language)
    position_embedding_type: str = "rope"   # "mrope" for vision-language families


def build_transformer_config(model: str | os.PathLike | dict | ModelConfig, *, tp: int = 1, pp: int = 1,
                             vpp: int | None = None, cp: int = 1, sequence_parallel: bool = False,
                             dtype: str | torch.dtype = "float32",
                             make_vocab_size_divisible_by: int = 128,
                             recompute: dict | None = None, attention_backend: str | None = None,
                             ep: int = 1, etp: int | None = None, moe=None,
                             **overrides: Any):
    """Translate an HF config of a supported family (a model folder, a config.json's contents
    as a dict, or hf_model.model_config's reading). Returns (TransformerConfig, ModelArgs).

    `recompute`: the run's recompute_* options (see recompute_kwargs); `attention_backend`:
    ms-swift's name, mapped by megatron_attention_backend (None: Megatron's default).
    ep, etp, moe: expert (tensor) parallel sizes and `model.moe.MoEOptions` of an MoE family."""
    from megatron.core.transformer import TransformerConfig

    hf = (model if isinstance(model, ModelConfig) else model_config(model)).language
    family = detect_family(hf)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % tp != 0:
        valid = [t for t in range(1, heads + 1) if heads % t == 0]
        raise ValueError(f"--tensor_model_parallel_size {tp} does not divide the model's "
                         f"{heads} attention heads (num_attention_heads); valid values: {valid}")
    if kv_heads % tp != 0 and tp % kv_heads != 0:
        raise ValueError(f"--tensor_model_parallel_size {tp} and the model's {kv_heads} kv heads"
                         " (num_key_value_heads): one must divide the other")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding-window attention (config.json use_sliding_window=true) is "
                         "not supported yet")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported (llama family)")
    qkv_bias = family.qkv_bias if family.qkv_bias is not None else bool(hf.get("attention_bias"))
    if family.qkv_bias is None and hf.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true is not supported for {family.name} "
                         "(HF gives o_proj a bias too, which has no Megatron counterpart without "
                         "MLP biases)")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json hidden_act={act!r} is not supported; allowed: silu "
                         "(the gated MLP of the supported families)")
    ffn = hf["intermediate_size"]
    if ffn % tp != 0:
        raise ValueError(f"--tensor_model_parallel_size {tp} does not divide the model's MLP "
                         f"width {ffn} (intermediate_size); valid values: "
                         f"{[t for t in range(1, heads + 1) if heads % t == 0 and ffn % t == 0]}")
    num_layers = hf["num_hidden_layers"]
    stages = pp * (vpp or 1)
    if num_layers % stages != 0:
        raise ValueError(f"the model's {num_layers} layers (num_hidden_layers) cannot be split "
                         f"evenly into --pipeline_model_parallel_size {pp} x "
                         f"--virtual_pipeline_model_parallel_size {vpp or 1} = {stages} stages")
    params_dtype = to_dtype(dtype)
    head_dim = head_size(hf)
    # With fewer kv heads than TP ranks, every rank keeps a replica of its kv head
    # (the bridge replicates the weights); Megatron then sees tp query groups.
    num_query_groups = max(kv_heads, tp) if kv_heads < tp else kv_heads
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=num_query_groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=family.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        variable_seq_lengths=True,
        # Batched p2p (torch's batch_isend_irecv) posts send_prev, recv_prev, send_next,
        # recv_next in that order on every rank; gloo pairs ops to one peer by order, so at
        # PP=2 (prev = next) the interleaved schedule's send_forward_backward_recv_* swaps
        # activation and gradient. Megatron's unbatched path orders even/odd ranks and uses
        # a second group for one direction, which pairs correctly. NCCL groups batched ops.
        batch_p2p_comm=torch.cuda.is_available(),
        moe_token_dispatcher_type="alltoall",  # dense models; allgather refuses variable lengths
        cross_entropy_loss_fusion=False,
    )
    if family.moe:
        kwargs.update(moe_config_kwargs(hf, family, tp=tp, ep=ep, etp=etp, options=moe))
    elif ep > 1 or etp not in (None, 1, tp):
        raise ValueError(f"--expert_model_parallel_size {ep} / --expert_tensor_parallel_size "
                         f"{etp} need a mixture-of-experts model; {family.name} is dense")
    if family.vision:
        kwargs["mrope_section"] = _mrope_section(hf)
        if sum(kwargs["mrope_section"]) * 2 != head_dim:
            raise ValueError(f"config.json mrope_section {kwargs['mrope_section']} must sum to "
                             f"head_dim / 2 = {head_dim // 2}")
    kwargs.update(recompute_kwargs(**(recompute or {})))
    if attention_backend is not None:
        kwargs["attention_backend"] = megatron_attention_backend(attention_backend)
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    vocab = hf["vocab_size"]
    args = ModelArgs(
        family=family,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab, tp, make_vocab_size_divisible_by),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        rotary_base=_rope_theta(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hf_config=hf,
        position_embedding_type="mrope" if family.vision else "rope",
    )
    return config, args


def recompute_kwargs(recompute_granularity: str | None = None, recompute_method: str | None = None,
                     recompute_num_layers: int | None = None,
                     recompute_modules: list | None = None) -> dict:
    """ms-swift's recompute_* options as TransformerConfig fields ("none" -> no recompute).

    selective: the listed submodules of every layer run again in backward (Megatron keeps
    only their inputs); full: whole layers do, by uniform groups of recompute_num_layers or
    the first recompute_num_layers of each stage (block)."""
    if recompute_granularity in (None, "none"):
        return {}
    out = {"recompute_granularity": recompute_granularity}
    if recompute_granularity == "full":
        out.update(recompute_method=recompute_method, recompute_num_layers=recompute_num_layers)
    else:
        out["recompute_modules"] = list(recompute_modules or ["core_attn"])
    return out


def megatron_attention_backend(name: str, use_te: bool | None = None):
    """ms-swift's --attention_backend as Megatron's AttnBackend.

    With Transformer Engine every value passes through. Without it (CPU) the layer spec
    holds Megatron's local attention whatever the value: local, unfused and auto name it
    (AttnBackend.local), flash and fused would be Transformer Engine kernels: refused."""
    from megatron.core.transformer.enums import AttnBackend

    use_te = use_transformer_engine() if use_te is None else use_te
    if use_te:
        return AttnBackend[name]
    if name in ("flash", "fused"):
        raise ValueError(f"--attention_backend {name} needs Transformer Engine on a GPU; this "
                         "machine runs Megatron's local attention. Fix: --attention_backend auto "
                         "(or local, unfused)")
    if name not in ("local", "unfused", "auto"):
        raise ValueError(f"--attention_backend {name!r} is not valid; allowed values: flash, "
                         "fused, unfused, local, auto")
    return AttnBackend.local
