"""Qwen2.5-VL without torchvision, for tests: the package's patches
(megatron_grpo/platform/compat/transformers.py and compat/vllm.py, where the why is
written down) under the names the VL tests import. With torchvision installed (GPU
stacks) they load HF's own processor and patch nothing.
"""
from __future__ import annotations

from megatron_grpo.platform.compat import transformers as compat_transformers
from megatron_grpo.platform.compat import vllm as compat_vllm

MODEL_TYPE = "qwen2_5_vl"
torchvision_available = compat_transformers.torchvision_available


def load_processor(model_dir):
    """The model's processor: HF's own where torchvision exists, else image-only."""
    return compat_transformers.load_processor(str(model_dir), MODEL_TYPE)


def install_vllm() -> None:
    """The patches, before an in-process `vllm.LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    compat_vllm.image_models_without_torchvision(MODEL_TYPE)
