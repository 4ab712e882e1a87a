"""HF config -> Megatron TransformerConfig, layer spec and GPTModel chunks."""
from .builder import build_model, layer_spec, unwrap, use_transformer_engine, wrap_ddp
from .config import ModelArgs, build_transformer_config, padded_vocab_size
from .families import FAMILIES, detect_family, supported_architectures

__all__ = ["build_model", "layer_spec", "unwrap", "use_transformer_engine", "wrap_ddp", "ModelArgs",
           "build_transformer_config", "padded_vocab_size", "FAMILIES",
           "detect_family", "supported_architectures"]
