"""HF <-> Megatron weights for the Llama / Qwen2 / Qwen3 families.

Three layers with narrow contracts:
- `bridge.mappings`: declarative per-family rules, HF name <-> Megatron name, TP split
  and fused layouts (pure arithmetic, no process groups);
- `bridge.load`: HF safetensors -> this rank's shards, each rank reading only its slices;
- `bridge.export`: shards -> a stream of buckets of full HF tensors on every rank
  (`Iterator[list[tuple[str, Tensor]]]`), which a transport (vLLM, disk) consumes.
"""
from .export import BucketBuffer, export_hf_weights
from .load import check_checkpoint, load_hf_weights, manifest
from .mappings import MAPPINGS, get_mapping, register_mapping

__all__ = ["BucketBuffer", "export_hf_weights", "check_checkpoint", "load_hf_weights", "manifest",
           "MAPPINGS", "get_mapping", "register_mapping"]
