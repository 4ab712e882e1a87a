"""Shared pieces for tests that drive real Megatron-Core models on gloo ranks."""
from __future__ import annotations

import torch

# A tiny Qwen2 as its HF config.json says it (GQA 4:2, qkv bias, untied).
TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "vocab_size": 1000, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "rope_theta": 10000.0,
}


def setup(world_size: int, tp: int = 1, pp: int = 1, vpp: int | None = None, hf=None,
          seed: int = 1234, **config_kwargs):
    """Init parallel state and build this rank's model chunks. Returns (config, args, chunks)."""
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp, vpp=vpp), seed=seed)
    config, args = build_transformer_config(hf or TINY_QWEN2, tp=tp, pp=pp, vpp=vpp,
                                            **config_kwargs)
    torch.manual_seed(seed)
    return config, args, build_model(config, args)


def fixed_batches(num_microbatches: int, micro_batch_size: int, seq_len: int, vocab: int,
                  seed: int = 0):
    """Deterministic (input_ids, position_ids, labels) micro-batches, same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, vocab, (micro_batch_size, seq_len + 1), generator=g)
        pos = torch.arange(seq_len).unsqueeze(0).expand(micro_batch_size, -1)
        out.append((tokens[:, :-1].contiguous(), pos.contiguous(), tokens[:, 1:].contiguous()))
    return out


def run_schedule(chunks, batches, seq_len, micro_batch_size, forward_only=False,
                 collect_logits=False):
    """One pass of Megatron's pipeline schedule over `batches` with a token-mean CE loss.

    Returns the per-micro-batch losses seen on the last stage (empty elsewhere) and,
    with collect_logits, the TP-gathered logits of each micro-batch [b, s, V].
    """
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    logits_out = []

    def forward_step(data_iterator, model):
        ids, pos, labels = next(data_iterator)
        if collect_logits:
            out = model(ids, pos, None)  # [b, s, V/tp] on the last stage

            def loss_fn(o):
                full = tensor_parallel.gather_from_tensor_model_parallel_region(o)
                logits_out.append(full.detach().float())
                loss = o.float().sum() * 0.0
                return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place
            return out, loss_fn
        out = model(ids, pos, None, labels=labels)  # per-token CE [b, s] on the last stage

        def loss_fn(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place
        return out, loss_fn

    vpp = len(chunks) > 1
    iters = [iter(batches) for _ in chunks] if vpp else iter(batches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters,
        model=chunks, num_microbatches=len(batches), seq_length=seq_len,
        micro_batch_size=micro_batch_size, forward_only=forward_only)
    return [d["loss"].item() for d in losses], logits_out


def lora_model(config, args, model_dir: str, settings):
    """This rank's chunks with the HF weights of model_dir loaded and LoRA (settings) on."""
    from bridge import load_hf_weights
    from megatron_grpo.model import build_model
    from megatron_grpo.model.lora import apply_lora

    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, model_dir)
    apply_lora(chunks, config, args, settings)
    return chunks


def randomize_lora_b(chunks, generator: torch.Generator, scale: float = 0.1) -> None:
    """Every adapter's B (zero after apply_lora, which would hide A from every check) drawn
    from `generator`: the language model's and the vision tower's. A generator seeded alike
    on every rank gives replicated factors equal on all of them."""
    from megatron_grpo.model.lora import adapters, tower_adapters

    with torch.no_grad():
        for _, _, adapter in adapters(chunks):
            for b in adapter.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=generator) * scale)
        for _, layer in tower_adapters(chunks):
            b = layer.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=generator) * scale)
