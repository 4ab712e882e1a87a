"""Build the GPTModel chunk(s) this rank owns from a Hugging Face config.

    config, args = build_transformer_config(hf_dir, tp=2, pp=2)
    chunks = build_model(config, args)     # one GPTModel per virtual stage of this rank

Megatron's parallel state must be initialised first (`platform.init_parallel`).
"""
from __future__ import annotations

import torch

from bridge.params import unwrap  # noqa: F401  (re-exported: one definition, the bridge's)
from megatron_grpo.platform.compat.megatron import moe_without_transformer_engine

from .config import ModelArgs
from .kv_replication import install_grouped_qkv_checkpointing
from .layers import RMSNorm
from .te import HAVE_TE, use_transformer_engine  # noqa: F401  (re-exported)


def _moe_spec_kwargs(config) -> dict:
    """An MoE config's layers get Megatron's MoELayer as their MLP (model/moe.py)."""
    if not config.num_moe_experts:
        return {}
    moe_without_transformer_engine()
    return {"num_experts": config.num_moe_experts, "moe_grouped_gemm": config.moe_grouped_gemm}


def layer_spec(config, use_te: bool | None = None, padding_free: bool = False):
    """The block spec: Transformer Engine's layers on GPU, Megatron's local ones elsewhere.

    padding_free: the model will read packed sequences (PackedSeqParams, THD). TE's
    attention takes them as they are; the local spec needs our core attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules)

    use_te = use_transformer_engine() if use_te is None else use_te
    if use_te:
        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, **_moe_spec_kwargs(config))
        final_norm = specs.TENorm if hasattr(specs, "TENorm") else RMSNorm
    else:
        layer = specs.get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                               normalization="RMSNorm", **_moe_spec_kwargs(config))
        sub = layer.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        attn = sub.self_attention.submodules
        if config.qk_layernorm:
            # q/k norms act per head on [.., head_dim]: not sequence-split, so the plain
            # module (no sequence_parallel tag) would be wrong only under SP; ours is fine.
            attn.q_layernorm = RMSNorm
            attn.k_layernorm = RMSNorm
        if config.context_parallel_size > 1 or padding_free:
            # Megatron's local attention refuses CP and packed sequences; ours exchanges
            # K/V across the CP group and keeps packed sequences apart.
            from .cp_attention import ContextParallelDotProductAttention

            attn.core_attention = ContextParallelDotProductAttention
        final_norm = RMSNorm
    return layer, final_norm


def build_model(config, args: ModelArgs, use_te: bool | None = None,
                wrap_with_ddp: bool = False, padding_free: bool = False) -> list:
    """GPTModel chunks of this rank: one, or one per virtual stage under VPP.

    padding_free (--padding_free): the chunks are built for packed micro-batches and
    carry `padding_free = True`, which train/engine.py reads to pack every micro-batch
    it feeds them (train/packing.py): the layout is a property of the model built for it,
    so the model and its inputs cannot disagree."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layer, final_norm = layer_spec(config, use_te, padding_free)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        n_layers = get_num_layers_to_build(config, vp_stage=stage)
        block = ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
            layer_specs=[layer] * n_layers, layer_norm=final_norm))
        model_cls, extra = GPTModel, {}
        if args.family.vision:   # + the HF vision tower on the embedding chunk (model/vision.py)
            from .vision import VisionLanguageModel

            model_cls = VisionLanguageModel
            extra = dict(hf_config=args.hf_config, family=args.family.name)
        model = model_cls(
            config=config,
            transformer_layer_spec=block,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_sequence_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=args.tie_word_embeddings,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            vp_stage=stage,
            **extra,
        )
        model.padding_free = bool(padding_free)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    # Replicated kv heads are saved in the TP-independent HF-grouped layout.
    install_grouped_qkv_checkpointing(chunks, config, args)
    if wrap_with_ddp:
        chunks = wrap_ddp(config, chunks)
    return chunks


def wrap_ddp(config, chunks: list, use_distributed_optimizer: bool = False,
             overlap_grad_reduce: bool = False) -> list:
    """Wrap chunks in Megatron's DistributedDataParallel (gradient buffers, DP reduction).

    Also installs the hooks Megatron's schedules call at the end of a backward pass:
    `finalize_model_grads` reduces gradients across data-parallel ranks, all-reduces
    the tied embedding gradient between the first and last pipeline stages and the
    sequence-parallel norm gradients across TP. Without it DP ranks silently train on
    their own gradients.
    """
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig,
                                           finalize_model_grads)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=chunk,
            # Only the first chunk's buckets may be padded/overlapped specially.
            disable_bucketing=i > 0))
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if overlap_grad_reduce:
        starts = [c.start_grad_sync for c in wrapped]
        config.grad_sync_func = starts[0] if len(starts) == 1 else starts
    return wrapped
