"""The rules every Llama-style dense decoder shares (Llama, Qwen2, Qwen3, ...).

Megatron names on the left (local layer spec first, then Transformer Engine's
fused-norm name), HF names on the right; `{layer}` is the global layer index.
"""
from __future__ import annotations

from .base import Rule
from .layouts import FUSED_GATE_UP, FUSED_QKV, REPLICATED, ROW, VOCAB

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."

EMBEDDING = Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",),
                 (("vocab", "hidden"),), VOCAB)

INPUT_NORM = Rule((L + "input_layernorm.weight", L + "self_attention.linear_qkv.layer_norm_weight"),
                  (H + "input_layernorm.weight",), (("hidden",),), REPLICATED)

QKV_WEIGHT = Rule((L + "self_attention.linear_qkv.weight",),
                  (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight",
                   H + "self_attn.v_proj.weight"),
                  (("q_out", "hidden"), ("kv_out", "hidden"), ("kv_out", "hidden")), FUSED_QKV)

# Qwen2 always, Llama/Qwen3 when config.json says attention_bias.
QKV_BIAS = Rule((L + "self_attention.linear_qkv.bias",),
                (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"),
                (("q_out",), ("kv_out",), ("kv_out",)), FUSED_QKV, when="qkv_bias")

ATTN_OUT = Rule((L + "self_attention.linear_proj.weight",), (H + "self_attn.o_proj.weight",),
                (("hidden", "q_out"),), ROW)

MLP_NORM = Rule((L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
                (H + "post_attention_layernorm.weight",), (("hidden",),), REPLICATED)

MLP_IN = Rule((L + "mlp.linear_fc1.weight",), (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
              (("ffn", "hidden"), ("ffn", "hidden")), FUSED_GATE_UP)

MLP_OUT = Rule((L + "mlp.linear_fc2.weight",), (H + "mlp.down_proj.weight",),
               (("hidden", "ffn"),), ROW)

FINAL_NORM = Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), (("hidden",),),
                  REPLICATED)

# Untied: its own tensor. Tied: with PP > 1 the last stage holds a copy of the embedding
# (Megatron keeps the two in sync through its embedding group); with PP = 1 it does not exist.
OUTPUT = Rule(("output_layer.weight",), ("lm_head.weight",), (("vocab", "hidden"),), VOCAB,
              tied_hf=("model.embed_tokens.weight",))

ATTENTION = (INPUT_NORM, QKV_WEIGHT, QKV_BIAS)
AFTER_ATTENTION = (ATTN_OUT, MLP_NORM, MLP_IN, MLP_OUT)


def dense_rules(*extra_attention: Rule) -> tuple[Rule, ...]:
    """embedding, per layer [norm, qkv(, bias), *extra_attention, o_proj, norm, mlp], norm, head."""
    return (EMBEDDING, *ATTENTION, *extra_attention, *AFTER_ATTENTION, FINAL_NORM, OUTPUT)
