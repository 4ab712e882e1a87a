"""model/config.py: HF config fields the translation cannot honour are refused, by name,
before anything is built (they used to build another model, or fail deep in Megatron)."""
import pytest

from tests.mcore_utils import TINY_QWEN2

QWEN3 = {**TINY_QWEN2, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
         "head_dim": 16}


@pytest.mark.parametrize("hf, tp, message", [
    # HF gives o_proj a bias with attention_bias (llama, qwen3): no Megatron counterpart
    ({**QWEN3, "attention_bias": True}, 1, "attention_bias=true is not supported for qwen3"),
    ({**TINY_QWEN2, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "attention_bias": True}, 1, "attention_bias=true is not supported for llama"),
    ({**TINY_QWEN2, "hidden_act": "gelu"}, 1, "hidden_act='gelu' is not supported; allowed: silu"),
    ({**TINY_QWEN2, "intermediate_size": 130}, 4,
     r"--tensor_model_parallel_size 4 does not divide the model's MLP width 130 "
     r"\(intermediate_size\); valid values: \[1, 2\]"),
])
def test_unsupported_fields_are_refused(hf, tp, message):
    from megatron_grpo.model import build_transformer_config

    with pytest.raises(ValueError, match=message):
        build_transformer_config(hf, tp=tp)


def test_supported_fields_build():
    from megatron_grpo.model import build_transformer_config

    config, args = build_transformer_config({**QWEN3, "hidden_act": "silu",
                                             "attention_bias": False}, tp=2)
    assert config.ffn_hidden_size == 128 and not config.add_qkv_bias
    config, _ = build_transformer_config(TINY_QWEN2, tp=1)
    assert config.add_qkv_bias               # Qwen2: q/k/v biases whatever attention_bias says
