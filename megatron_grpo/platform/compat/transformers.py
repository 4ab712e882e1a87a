"""transformers beyond its public API: Qwen2.5-VL's processor where torchvision does not
import (see compat/__init__.py for the rules; compat/vllm.py has vLLM's side).

Why. On the CPU stack torchvision is absent: PyPI's wheel for torch 2.13.0 is a CUDA
build (its `_C.so` links libc10_cuda / libtorch_cuda, so `import torchvision` fails with
"operator torchvision::nms does not exist"), and no `+cpu` build is reachable. Then

- `AutoProcessor.from_pretrained(<Qwen2.5-VL>)` raises ImportError ("Qwen2VLVideoProcessor
  requires the Torchvision library"), and `Qwen2_5_VLProcessor(..., video_processor=None)`
  fails its sub-processor type check; the image processor alone loads (transformers picks
  `Qwen2VLImageProcessorPil`, PIL + numpy);
- `transformers.models.qwen2_vl.image_processing_qwen2_vl` (the torchvision backend) does
  not import, and vLLM imports `smart_resize` from it.

What this module does, only when `import torchvision` fails (GPU stacks need none of it):

1. `install_image_processor_shim`: registers, under that module's name, a module holding
   the PIL implementation's `smart_resize`, image processor and its kwargs (the same
   resize function in both backends, so the image token counts agree);
2. `image_only_processor_cls`: `Qwen2_5_VLProcessor` (or Qwen2-VL's `Qwen2VLProcessor`,
   the same `__init__` in 5.19) with a tokenizer and an image processor only
   (ProcessorMixin reads the sub-processors from `__init__`'s signature).

Verified on transformers 5.19.0 (the range is setup.py's).
"""
from __future__ import annotations

import functools
import importlib
import sys
import types

from . import check_version as _check_range

LOWER, UPPER = (5, 16), (5, 20)     # setup.py's transformers>=5.16.1,<5.20
VERIFIED = "transformers 5.19.0"

_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_TV_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PRIVATE_NAMES = (
    f"{_PIL_MODULE}:smart_resize",
    f"{_PIL_MODULE}:Qwen2VLImageProcessorPil",
    f"{_PIL_MODULE}:Qwen2VLImageProcessorKwargs",
    "transformers.processing_utils:ProcessorMixin.__init__",
    "transformers:Qwen2_5_VLProcessor",
    "transformers:Qwen2VLProcessor",
)
# model_type -> the processor class this module can build without torchvision.
IMAGE_ONLY_PROCESSORS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor"}
IMAGE_ONLY_MODEL_TYPES = tuple(IMAGE_ONLY_PROCESSORS)

_checked = False


def installed_version() -> str:
    import transformers

    return transformers.__version__


def check_version() -> None:
    """Raise UntestedVersionError on a transformers outside LOWER..UPPER (see compat)."""
    global _checked
    if not _checked:
        _check_range("transformers", installed_version(), LOWER, UPPER, VERIFIED, "transformers")
        _checked = True


@functools.lru_cache(maxsize=1)
def torchvision_available() -> bool:
    """Whether torchvision imports (it may be installed and still fail: a CUDA build
    beside a CPU torch raises RuntimeError on import)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


def install_image_processor_shim() -> None:
    """Patch 1 (see the module docstring); a no-op where torchvision imports or where
    it is already installed."""
    if torchvision_available() or _TV_MODULE in sys.modules:
        return
    check_version()
    pil = importlib.import_module(_PIL_MODULE)
    shim = types.ModuleType(_TV_MODULE)
    shim.__doc__ = f"megatron-grpo: {_PIL_MODULE} under the torchvision backend's name"
    shim.smart_resize = pil.smart_resize
    shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    shim.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
    sys.modules[_TV_MODULE] = shim


@functools.lru_cache(maxsize=None)
def image_only_processor_cls(model_type: str = "qwen2_5_vl"):
    """Patch 2: the processor class of `model_type` without a video processor (one class
    per model type and process: vLLM caches processors by class)."""
    check_version()
    import transformers
    from transformers.processing_utils import ProcessorMixin

    base = getattr(transformers, IMAGE_ONLY_PROCESSORS[model_type])

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = "<|image_pad|>"
        self.video_token = "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return type(f"ImageOnly{base.__name__}", (base,), {
        "__init__": __init__, "__module__": __name__,
        "__doc__": f"{base.__name__} with a tokenizer and an image processor only: videos "
                   "are not supported where torchvision is absent."})


def load_processor(model_dir: str, model_type: str, **kwargs):
    """The model's own processor (chat template, tokenizer, image processor): HF's
    `AutoProcessor` where torchvision imports, else the image-only one. `kwargs` go to
    `from_pretrained` (e.g. max_pixels: the image processor's size["longest_edge"])."""
    if torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_dir, **kwargs)
    if model_type not in IMAGE_ONLY_MODEL_TYPES:
        raise ValueError(f"--model {model_dir}: a {model_type!r} processor needs torchvision, "
                         f"which does not import here; without it only "
                         f"{list(IMAGE_ONLY_MODEL_TYPES)} are supported")
    install_image_processor_shim()
    return image_only_processor_cls(model_type).from_pretrained(model_dir, **kwargs)
