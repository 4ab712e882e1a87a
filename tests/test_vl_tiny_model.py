"""The tiny Qwen2.5-VL of tools/make_tiny_vl_model.py: transformers reads it, its
processor turns a PIL-drawn image and an ms-swift `<image>` prompt into model inputs,
and Megatron-Core's GPTModel with
mrope reproduces its language model's logits on an image prompt (TP=1, TP=2).
Groundwork for the vision-language path; docs/vision-language.md says what each result means.

References: HF transformers in float32 on the same folder (the processor through
tests/vl_compat.py: no torchvision on the CPU stack). vLLM's side (log-probs equal to
HF's within ATOL) is tests/test_vl_data_rollout.py; a wrong image position (mrope), a
dropped vision block or a misplaced image embedding moves them by far more (see
test_image_and_positions_change_logits).
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.harness import run_distributed
from tests.vl_compat import load_processor
from tools.make_tiny_vl_model import IMAGE_BLOCK, make_tiny_vl_model

ATOL = 1e-5
TEMPERATURE = 0.7
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed")
# ms-swift's multimodal rows: `<image>` tags in the text, one image per tag.
PROMPTS = ["<image>How many red squares are there?", "Count the squares: <image>"]


def draw(width: int, height: int, squares: list[tuple[int, int, str]]):
    """A white PIL image with 12-pixel squares at (x, y) in the given colours."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(img)
    for x, y, colour in squares:
        pen.rectangle([x, y, x + 11, y + 11], fill=colour)
    return img


IMAGES = [  # (1, 6, 8) and (1, 4, 10) patch grids: 12 and 10 image tokens
    lambda: draw(112, 84, [(10, 10, "red"), (60, 40, "red"), (80, 10, "blue")]),
    lambda: draw(140, 56, [(5, 5, "green"), (100, 30, "red")]),
]


def chat_text(processor, prompt: str) -> str:
    """ms-swift's `<image>` tags -> Qwen2-VL content items -> the model's chat template."""
    content = []
    for i, piece in enumerate(prompt.split("<image>")):
        if i:
            content.append({"type": "image"})
        if piece:
            content.append({"type": "text", "text": piece})
    return processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)


def encode(processor, prompt: str, image):
    return processor(text=[chat_text(processor, prompt)], images=[image], return_tensors="pt")


def hf_logits(model, enc, completion=()):
    """Logits [T, V] of the prompt (+ completion ids) under HF, mrope positions included."""
    ids = torch.cat([enc["input_ids"][0], torch.tensor(completion, dtype=torch.long)])[None]
    types = torch.cat([enc["mm_token_type_ids"][0], torch.zeros(len(completion), dtype=torch.long)])
    with torch.no_grad():
        out = model(input_ids=ids, mm_token_type_ids=types[None], pixel_values=enc["pixel_values"],
                    image_grid_thw=enc["image_grid_thw"], use_cache=False)
    return out.logits[0].double()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_builder_is_deterministic_and_checks_args(model_dir, tmp_path):
    again = make_tiny_vl_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [4, 6, 6]
    with pytest.raises(ValueError, match=r"mrope_section=\[4, 4, 4\] must sum to head_dim / 2 = 16"):
        make_tiny_vl_model(tmp_path / "bad", mrope_section=(4, 4, 4))
    with pytest.raises(ValueError, match="min_pixels=100"):
        make_tiny_vl_model(tmp_path / "bad", min_pixels=100)


def test_processor_turns_image_prompt_into_inputs(model_dir):
    processor = load_processor(model_dir)
    tok = processor.tokenizer
    config = json.loads((model_dir / "config.json").read_text())
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config["image_token_id"]
    assert tok.convert_tokens_to_ids("<|vision_start|>") == config["vision_start_token_id"]

    text = chat_text(processor, PROMPTS[0])
    assert text == f"<|im_start|>user\n{IMAGE_BLOCK}How many red squares are there?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    enc = encode(processor, PROMPTS[0], IMAGES[0]())
    # 112x84 px is within the pixel budget and a multiple of 28: 6x8 patches of 14 px,
    # each row of pixel_values one patch of 3 channels x 2 frames x 14 x 14.
    assert enc["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert tuple(enc["pixel_values"].shape) == (48, 3 * 2 * 14 * 14)
    ids = enc["input_ids"][0].tolist()
    # One <|image_pad|> per 2x2 merged patches, between vision start and end.
    start = ids.index(config["vision_start_token_id"])
    assert ids[start + 1:start + 13] == [config["image_token_id"]] * 12
    assert ids[start + 13] == config["vision_end_token_id"]
    assert enc["mm_token_type_ids"][0].tolist() == [int(i == config["image_token_id"]) for i in ids]
    # An image larger than max_pixels is scaled down to the budget (16 merged patches).
    big = encode(processor, PROMPTS[1], draw(600, 400, []))
    t, h, w = big["image_grid_thw"][0].tolist()
    assert t == 1 and h * w // 4 <= 16 and h % 2 == 0 and w % 2 == 0


def test_image_and_positions_change_logits(model_dir, hf_model):
    """The HF forward runs, and what the trainer must reproduce matters: the pixels,
    and the mrope positions (3 ids per token: temporal, row, column)."""
    processor = load_processor(model_dir)
    enc = encode(processor, PROMPTS[0], IMAGES[0]())
    logits = hf_logits(hf_model, enc)
    assert torch.isfinite(logits).all()
    other = dict(enc, pixel_values=encode(processor, PROMPTS[0], draw(112, 84, []))["pixel_values"])
    assert (hf_logits(hf_model, other) - logits)[-1].abs().max() > 1e-2

    pos, delta = hf_model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                               enc["image_grid_thw"])
    ids = enc["input_ids"][0].tolist()
    first = ids.index(hf_model.config.image_token_id)
    image = pos[:, 0, first:first + 12]                  # [3, 12]: a 3x4 grid of merged patches
    assert image[0].tolist() == [first] * 12
    assert image[1].tolist() == [first + r for r in range(3) for _ in range(4)]
    assert image[2].tolist() == [first + c for _ in range(3) for c in range(4)]
    # Text after the image resumes at 1 + the largest image position, so the sequence
    # is "shorter" than its tokens: delta = positions - tokens.
    assert pos[0, 0, first + 12].item() == first + 4
    assert delta.item() == (first + 4) - (first + 12)
    # A plain 1D position ramp (what a text-only trainer would feed) changes the logits.
    with torch.no_grad():
        ramp = hf_model(**{k: v for k, v in enc.items() if k != "mm_token_type_ids"},
                        use_cache=False).logits[0].double()
    assert (ramp - logits).abs().max() > 1e-2


# vLLM on image prompts (ColocateEngine and `megatron rollout`, prompt ids and log-probs
# against HF): tests/test_vl_data_rollout.py.


# --------------------------------------------------------------------------- Megatron mrope
def _mcore_mrope_rank(rank, world_size, position_ids, head_dim, mrope_section, theta):
    from megatron_grpo.platform import cpu

    cpu.install()   # MultimodalRotaryEmbedding builds its frequencies on "the CUDA device"
    from megatron.core.models.common.embeddings.rotary_pos_embedding import \
        MultimodalRotaryEmbedding

    rope = MultimodalRotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=theta)
    return rope(position_ids, mrope_section)      # [s, b, 1, head_dim] angles


def test_megatron_mrope_matches_hf(model_dir, hf_model):
    """Megatron-Core's MultimodalRotaryEmbedding (GPTModel position_embedding_type="mrope",
    TransformerConfig.mrope_section) on HF's get_rope_index positions gives HF's
    rotary angles: the trainer can feed Megatron the [3, b, s] positions as they are."""
    processor = load_processor(model_dir)
    enc = encode(processor, PROMPTS[1], IMAGES[1]())
    pos, _ = hf_model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                           enc["image_grid_thw"])              # [3, 1, s]
    text = hf_model.config.text_config
    section = text.rope_parameters["mrope_section"]
    [angles] = run_distributed(_mcore_mrope_rank, world_size=1, timeout=120,
                               args=(pos, text.hidden_size // text.num_attention_heads, section,
                                     text.rope_parameters["rope_theta"]))
    x = torch.zeros(1, pos.shape[-1], text.hidden_size)
    cos, sin = hf_model.model.language_model.rotary_emb(x, pos)               # [1, s, head_dim]
    assert torch.allclose(angles[:, 0, 0].cos(), cos[0], atol=1e-6)
    assert torch.allclose(angles[:, 0, 0].sin(), sin[0], atol=1e-6)
    # The image's row and column ids reach different frequency bands than a 1D ramp's.
    ramp = torch.arange(pos.shape[-1]).view(1, 1, -1).expand(3, 1, -1)
    assert not torch.allclose(hf_model.model.language_model.rotary_emb(x, ramp)[0], cos, atol=1e-3)


# --------------------------------------------------------------------------- Megatron LM
def text_only_checkpoint(vl_dir, out_dir):
    """The language half of a Qwen2.5-VL folder as a Qwen2 checkpoint (same tensors, same
    names: Qwen2.5-VL's language weights are saved as `model.*` / `lm_head.*`)."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    vl = json.loads((vl_dir / "config.json").read_text())
    text = dict(vl["text_config"], architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                rope_theta=vl["text_config"]["rope_parameters"]["rope_theta"])
    (out_dir / "config.json").write_text(json.dumps(text))
    tensors = load_file(vl_dir / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("visual.")},
              out_dir / "model.safetensors")
    return out_dir


def _mcore_vl_rank(rank, world_size, text_dir, input_ids, position_ids, image_embeds,
                   image_token_id, mrope_section):
    """Megatron-Core's GPTModel with mrope on an image prompt: Megatron's own word
    embeddings with the image rows replaced by the vision tower's output, passed as
    `decoder_input` (the recipe of docs/vision-language.md)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                             TransformerBlockSubmodules)

    from megatron.core import tensor_parallel

    from bridge.load import load_hf_weights
    from megatron_grpo.model import build_transformer_config, layer_spec
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=world_size, pp=1), seed=1)
    config, args = build_transformer_config(text_dir, tp=world_size,
                                            mrope_section=list(mrope_section))
    layer, final_norm = layer_spec(config)
    block = ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * config.num_layers, layer_norm=final_norm))
    model = GPTModel(config=config, transformer_layer_spec=block,
                     vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_sequence_length,
                     share_embeddings_and_output_weights=args.tie_word_embeddings,
                     position_embedding_type="mrope", rotary_base=args.rotary_base)
    load_hf_weights([model], config, args, text_dir)
    model.eval()
    with torch.no_grad():
        # Vocab-parallel lookup: every TP rank gets the full [b, s, h] rows.
        emb = model.embedding.word_embeddings(input_ids)
        emb[input_ids == image_token_id] = image_embeds.to(emb.dtype)     # in token order
        logits = model(input_ids, position_ids, None,
                       decoder_input=emb.transpose(0, 1).contiguous())    # [b, s, V_pad/tp]
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits[..., :args.vocab_size]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_megatron_language_model_matches_hf_on_image_prompt(model_dir, hf_model, tmp_path, tp):
    """GPTModel(position_embedding_type="mrope") loaded by the bridge's Qwen2 rules, fed
    HF's vision-tower output at the image tokens and get_rope_index's positions: HF's
    logits (fp32, 1e-4; observed 2.9e-6, while a 1D position ramp moves them by 1.6 and
    zeroed image rows by 3.9), so the language half of Qwen2.5-VL needs no new layers."""
    processor = load_processor(model_dir)
    enc = encode(processor, PROMPTS[0], IMAGES[0]())
    ids = enc["input_ids"]
    pos, _ = hf_model.model.get_rope_index(ids, enc["mm_token_type_ids"], enc["image_grid_thw"])
    with torch.no_grad():
        image_embeds = hf_model.model.get_image_features(
            enc["pixel_values"], enc["image_grid_thw"]).pooler_output
    image_embeds = torch.cat(list(image_embeds)) if isinstance(image_embeds, (list, tuple)) \
        else image_embeds
    text_cfg = hf_model.config.text_config
    logits, *others = run_distributed(
        _mcore_vl_rank, world_size=tp, timeout=180,
        args=(str(text_only_checkpoint(model_dir, tmp_path / "text")), ids, pos, image_embeds,
              hf_model.config.image_token_id, text_cfg.rope_parameters["mrope_section"]))
    ref = hf_logits(hf_model, enc)
    assert (logits[0].double() - ref).abs().max() < 1e-4
    assert all(torch.equal(o, logits) for o in others)   # TP ranks agree
