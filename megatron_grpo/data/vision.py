"""Image prompts of a vision-language model (Qwen2.5-VL): ms-swift's rows -> what vLLM
samples from and what the trainer's forward needs.

    vp = VisionProcessor(model_dir, max_pixels=cfg.data.max_pixels)   # or MAX_PIXELS
    prompt = vp.encode(dataset.messages[i], dataset.images[i])
    engine.generate([prompt.vllm_prompt_ids], images=[prompt.images],
                    mm_processor_kwargs=vp.mm_processor_kwargs)
    # trainer: prompt.prompt_ids, prompt.pixel_values, prompt.image_grid_thw

ms-swift's format: `messages` (or `query`) whose text holds one `<image>` tag per image,
and an `images` column: a list (or one) of file paths, raw bytes, `{"bytes", "path"}`
dicts (a parquet Image column), `data:image/...;base64,` strings or PIL images. Fewer
tags than images: the missing tags go at the start of the first user turn (ms-swift's
rule); more tags than images is a row error.

The prompt is rendered by the model's own processor (its chat template, with Qwen2-VL's
content items: the text split on `<image>`), then encoded once by its image processor:

- `prompt_ids`: the trainer's ids, each `<|image_pad|>` repeated once per merged patch
  (t*h*w / merge_size^2 of the image's `image_grid_thw`);
- `vllm_prompt_ids`: the same prompt with ONE `<|image_pad|>` per image: vLLM expands the
  placeholder itself (ids already expanded would be expanded again, silently wrong). vLLM
  returns the expanded ids; `check_expanded` holds them to `prompt_ids`;
- `pixel_values` [patches, C*T*P*P] and `image_grid_thw` [images, 3], and
  `mm_token_type_ids` (1 at image tokens: HF's forward computes mrope positions from it).

The pixel budget: `--max_pixels`, else ms-swift's `MAX_PIXELS` environment variable,
else the model's preprocessor_config.json. It goes to the trainer's processor and to
vLLM's (`mm_processor_kwargs`), so both resize an image alike and agree on its tokens.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

IMAGE_TAG = "<image>"
MAX_PIXELS_ENV = "MAX_PIXELS"
# model_type values of the vision-language families this project handles.
VISION_LANGUAGE_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")


def model_type(model_dir: str) -> Optional[str]:
    """config.json's model_type (no heavy import)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def is_vision_language(model_dir: str) -> bool:
    return model_type(model_dir) in VISION_LANGUAGE_MODEL_TYPES


def resolve_max_pixels(max_pixels: Optional[int], model_dir: Optional[str] = None,
                       environ: Optional[Dict[str, str]] = None) -> Optional[int]:
    """The image pixel budget: --max_pixels, else $MAX_PIXELS, else None (the model's own).

    Checked against the model's `min_pixels` (preprocessor_config.json) when model_dir is
    given: a budget below it cannot be met by any resize."""
    environ = os.environ if environ is None else environ
    option = "--max_pixels"
    if max_pixels is None and environ.get(MAX_PIXELS_ENV, "").strip():
        option, raw = f"{MAX_PIXELS_ENV} (environment)", environ[MAX_PIXELS_ENV].strip()
        try:
            max_pixels = int(raw)
        except ValueError:
            raise ValueError(f"{option}={raw!r} is not an integer number of pixels "
                             "(e.g. MAX_PIXELS=1003520)") from None
    if max_pixels is None:
        return None
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"{option}={max_pixels!r} must be a positive number of pixels "
                         "(height x width), e.g. 1003520")
    low = _min_pixels(model_dir) if model_dir else None
    if low is not None and max_pixels < low:
        raise ValueError(f"{option}={max_pixels} is below the model's min_pixels={low} "
                         f"({model_dir}/preprocessor_config.json); allowed: >= {low}")
    return max_pixels


def _min_pixels(model_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    low = config.get("min_pixels") or (config.get("size") or {}).get("shortest_edge")
    return int(low) if low else None


# ------------------------------------------------------------------ rows
def image_refs(value: Any, where: str) -> List[Any]:
    """A row's `images` value as a list of image references (None/[] -> [])."""
    if value is None:
        return []
    refs = list(value) if isinstance(value, (list, tuple)) else [value]
    for ref in refs:
        if not (isinstance(ref, (str, bytes, bytearray)) or _is_pil(ref) or
                (isinstance(ref, dict) and (ref.get("bytes") or ref.get("path")))):
            raise ValueError(f"{where}: an image must be a path, bytes, a {{'bytes', 'path'}} "
                             f"dict or a data:image base64 string, got {type(ref).__name__}")
    return refs


def add_image_tags(messages: List[Dict[str, str]], num_images: int,
                   where: str) -> List[Dict[str, str]]:
    """ms-swift's rule: missing `<image>` tags go at the start of the first user turn;
    more tags than images is an error."""
    tags = sum(m["content"].count(IMAGE_TAG) for m in messages)
    if tags > num_images:
        raise ValueError(f"{where}: its messages hold {tags} {IMAGE_TAG} tags but its `images` "
                         f"column {num_images} image(s); each tag takes one image, in order")
    if tags == num_images:
        return messages
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    out = [dict(m) for m in messages]
    out[first]["content"] = IMAGE_TAG * (num_images - tags) + out[first]["content"]
    return out


def content_items(messages: List[Dict[str, str]]) -> List[Dict[str, Any]]:
    """`<image>` tags -> Qwen2-VL content lists ({"type": "image"} / {"type": "text"})."""
    out = []
    for m in messages:
        if IMAGE_TAG not in m["content"]:
            out.append(m)
            continue
        items: List[Dict[str, Any]] = []
        for i, piece in enumerate(m["content"].split(IMAGE_TAG)):
            if i:
                items.append({"type": "image"})
            if piece:
                items.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": items})
    return out


def _is_pil(obj: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(obj, Image.Image)


def load_image(ref: Any, base_dir: Optional[str] = None):
    """One image reference -> an RGB PIL image. A relative path is looked up as given,
    then next to the dataset file (`base_dir`)."""
    from PIL import Image

    if _is_pil(ref):
        return ref.convert("RGB")
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref)).convert("RGB")
    if ref.startswith("data:image"):
        return Image.open(io.BytesIO(base64.b64decode(ref.partition(",")[2]))).convert("RGB")
    if re.match(r"^[a-z]+://", ref):
        raise ValueError(f"image {ref!r}: URLs are not downloaded; save the image and give its "
                         "path (or its bytes) in the `images` column")
    path = ref
    if not os.path.isfile(path) and base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, ref)
    if not os.path.isfile(path):
        raise ValueError(f"image {ref!r}: file not found (looked in the working directory"
                         + (f" and in {base_dir}" if base_dir else "") + ")")
    with Image.open(path) as img:
        return img.convert("RGB")


def png_base64(image) -> str:
    """An image as a `data:image/png;base64,` string (lossless: the server decodes the
    same pixels the trainer processed)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ------------------------------------------------------------------ encoding
@dataclass
class VisionPrompt:
    """One image prompt, encoded once (see the module docstring)."""
    prompt_ids: List[int]           # expanded: the trainer's
    vllm_prompt_ids: List[int]      # one <|image_pad|> per image: vLLM's input
    images: List[Any]               # RGB PIL images, in tag order
    pixel_values: Any               # torch [patches, C*T*P*P]
    image_grid_thw: Any             # torch [images, 3]
    mm_token_type_ids: List[int]    # 1 at image tokens

    def check_expanded(self, vllm_ids: Sequence[int]) -> None:
        """Raise when vLLM expanded the prompt differently (e.g. another pixel budget)."""
        if list(vllm_ids) != self.prompt_ids:
            raise RuntimeError(
                f"vLLM expanded an image prompt to {len(vllm_ids)} tokens, the trainer's "
                f"processor to {len(self.prompt_ids)}: they resized the image differently. "
                f"Pass the same --max_pixels / {MAX_PIXELS_ENV} to both (the engine must get "
                "VisionProcessor.mm_processor_kwargs)")


class VisionProcessor:
    """The model's own processor (chat template, tokenizer, image processor) with the
    run's pixel budget."""

    def __init__(self, model_dir: str, max_pixels: Optional[int] = None) -> None:
        # platform/__init__ imports torch (and config/, which imports this module): the CLI
        # parent reads datasets through here without torch
        from ..platform.compat import transformers as compat_transformers

        kind = model_type(model_dir)
        if kind not in VISION_LANGUAGE_MODEL_TYPES:
            raise ValueError(f"--model {model_dir}: model_type {kind!r} is not a vision-language "
                             f"model this project handles ({list(VISION_LANGUAGE_MODEL_TYPES)})")
        self.model_dir = model_dir
        self.max_pixels = resolve_max_pixels(max_pixels, model_dir)
        self.processor = compat_transformers.load_processor(model_dir, kind, **self.mm_processor_kwargs)
        self.tokenizer = self.processor.tokenizer
        self.image_token = self.processor.image_token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        # merged patches per image token along each side (vision_config.spatial_merge_size)
        self.spatial_merge_size = int(getattr(self.processor.image_processor, "merge_size", 2))

    @property
    def mm_processor_kwargs(self) -> Dict[str, Any]:
        """What vLLM's processor needs to resize as this one does."""
        return {} if self.max_pixels is None else {"max_pixels": self.max_pixels}

    def render(self, messages: List[Dict[str, str]], enable_thinking: Optional[bool] = None) -> str:
        """The prompt text (generation prompt included), one image block per `<image>`."""
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self.processor.apply_chat_template(content_items(messages), tokenize=False,
                                                  add_generation_prompt=True, **extra)

    def check_placeholders(self, dataset, what: str = "--dataset") -> None:
        """Every row with images renders one image placeholder per image through the
        model's chat template; else ValueError naming the template, the row and the counts
        (a template that renders list-valued content as nothing drops the images, and vLLM
        would fail on the prompt only once the models are loaded). Rows of one shape (roles
        and images per message) render alike: each shape is rendered once."""
        if dataset is None or dataset.images is None:
            return
        seen = set()
        for i, (messages, images) in enumerate(zip(dataset.messages, dataset.images)):
            n = len(image_refs(images, f"{what} row {i}"))
            if not n:
                continue
            tagged = add_image_tags(messages, n, f"{what} row {i}")
            shape = tuple((m["role"], m["content"].count(IMAGE_TAG)) for m in tagged)
            if shape in seen:
                continue
            seen.add(shape)
            found = self.render(tagged).count(self.image_token)
            if found != n:
                raise ValueError(
                    f"the chat template of {self.model_dir} renders {found} image placeholder(s) "
                    f"({self.image_token}) for {what} row {i}, which has {n} image(s): the "
                    "template must render each image item of a message's content list (as "
                    "Qwen2-VL's does). Fix: the model's own chat_template (chat_template.json "
                    "or chat_template.jinja), or a row whose images its template shows")

    def encode(self, messages: List[Dict[str, str]], images: Sequence[Any],
               base_dir: Optional[str] = None, enable_thinking: Optional[bool] = None) -> VisionPrompt:
        messages = add_image_tags(messages, len(images), "prompt")
        pil = [load_image(ref, base_dir) for ref in images]
        text = self.render(messages, enable_thinking)
        vllm_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not pil:
            import torch

            return VisionPrompt(vllm_ids, list(vllm_ids), [], torch.zeros(0), torch.zeros(0, 3,
                                dtype=torch.long), [0] * len(vllm_ids))
        enc = self.processor(text=[text], images=pil, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        types = enc.get("mm_token_type_ids")
        types = types[0].tolist() if types is not None else \
            [int(t == self.image_token_id) for t in ids]
        return VisionPrompt(prompt_ids=ids, vllm_prompt_ids=vllm_ids, images=pil,
                            pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                            mm_token_type_ids=types)
