"""Tests for tools/make_tiny_model.py: the checkpoints it writes load in HF transformers
(vLLM: tests/test_rollout_colocate.py), mean what their config.json says, and are reproducible.

The forward check compares HF's fp32 logits with a float64 reference written here from
the architectures' formulas (RMSNorm, RoPE with rotate-half, GQA, causal softmax, SwiGLU,
Qwen2's qkv bias, Qwen3's per-head q/k norm), reading only config.json and the
safetensors files, so a checkpoint whose config and weights disagree fails.
"""
from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from tools.make_tiny_model import main, make_tiny_model

TEXTS = [
    "What is 12 + 345? The answer is 357.",
    "<think>\nFirst, 3 + 4 = 7.\n</think>\n<answer>(3 + 4) * 5</answer>",
    "Using the numbers [19, 36, 55, 7], create an equation that equals 65.",
    "Unseen characters still encode: ünïcode ✓ 🙂",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
]


def _load_tensors(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint."""
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    """Rotate-half RoPE on x [T, heads, D] (HF layout: pairs are (i, i + D/2))."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    angles = positions[:, None].double() * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_logits(model_dir: pathlib.Path, input_ids: list[int]) -> torch.Tensor:
    """Float64 causal-LM forward of a llama/qwen2/qwen3 checkpoint; returns [T, vocab]."""
    cfg = json.loads((model_dir / "config.json").read_text())
    w = {k: v.double() for k, v in _load_tensors(model_dir).items()}
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    t = len(input_ids)
    positions = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T] query i sees keys <= i

    h = w["model.embed_tokens.weight"][torch.tensor(input_ids)]  # [T, H]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(h, w[p + "input_layernorm.weight"], eps)

        def proj(name, heads):
            y = x @ w[p + f"self_attn.{name}.weight"].T
            if p + f"self_attn.{name}.bias" in w:  # Qwen2 only
                y = y + w[p + f"self_attn.{name}.bias"]
            return y.view(t, heads, head_dim)  # [T, heads, D]

        q, k, v = proj("q_proj", n_heads), proj("k_proj", n_kv), proj("v_proj", n_kv)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3: RMSNorm over each head, before RoPE
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        group = n_heads // n_kv  # query head j reads kv head j // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)  # [heads, T, T]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, n_heads * head_dim)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T

        x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    h = _rms_norm(h, w["model.norm.weight"], eps)
    lm_head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return h @ lm_head.T


FAMILY_CASES = {
    # family: make_tiny_model kwargs; each case also exercises an odd vocab and a
    # non-default rope theta / eps so that the reference must read them from config.json.
    "llama": dict(family="llama", vocab_size=1000, rope_theta=500.0, rms_norm_eps=1e-5),
    "qwen2": dict(family="qwen2", vocab_size=999, rope_theta=1000.0),
    "qwen3": dict(family="qwen3", vocab_size=1001, head_dim=32, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_family_loads_and_matches_reference(case, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = FAMILY_CASES[case]
    family = kwargs["family"]
    model_dir = make_tiny_model(tmp_path / "m", **kwargs)

    cfg = json.loads((model_dir / "config.json").read_text())
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}[family]
    assert cfg["architectures"] == [expected_arch] and cfg["model_type"] == family
    assert cfg["vocab_size"] == kwargs["vocab_size"]
    assert cfg["attention_dropout"] == 0.0
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert cfg["tie_word_embeddings"] == kwargs.get("tie_word_embeddings", False)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == expected_arch
    assert model.get_input_embeddings().weight.shape[0] == kwargs["vocab_size"]
    # The tokenizer may be smaller than the model's (padded) vocabulary, never larger.
    assert 259 < len(tok) <= kwargs["vocab_size"]

    # Weights are not trivial: norms are not all ones, Qwen2's biases are not zero,
    # Qwen3 has q/k norms of size head_dim, tying follows the flag.
    tensors = _load_tensors(model_dir)
    assert not torch.allclose(tensors["model.norm.weight"], torch.ones(1))
    if family == "qwen2":
        assert tensors["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
        assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    else:
        assert not any(k.endswith(".bias") for k in tensors)
    if family == "qwen3":
        assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (32,)
        assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    if cfg["tie_word_embeddings"]:
        assert "lm_head.weight" not in tensors
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])

    # Chat template -> ids -> HF forward, against the float64 reference.
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert max(ids) < len(tok)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [T, vocab]
    expected = reference_logits(model_dir, ids)
    assert logits.shape == (len(ids), kwargs["vocab_size"])
    assert (logits.double() - expected).abs().max().item() < 1e-4
    # Logits are O(1) and vary by position: attention is not uniform.
    assert expected.std().item() > 0.3
    assert (expected[-1] - expected[-2]).abs().max().item() > 0.1


def test_qwen_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m", family="qwen3"))
    n = len(tok)
    # Qwen's specials follow the BPE vocabulary, in Qwen's order.
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [n - 3, n - 2, n - 1]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    for text in TEXTS:  # byte-level BPE: lossless on any text
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # One token per digit, as Qwen's pre-tokenizer splits them.
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    gen = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [n - 1, n - 3] and gen["pad_token_id"] == n - 3


def test_llama_tokenizer_matches_sentencepiece(tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(tmp_path / "m", family="llama", vocab_size=999)
    tok = AutoTokenizer.from_pretrained(model_dir)
    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    assert sp.get_piece_size() == len(tok) <= 999
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == [1] + sp.encode(text)  # the fast conversion agrees with sentencepiece
        assert tok.decode(ids, skip_special_tokens=True) == text
    chat = MESSAGES + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3 + 4?"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is 2 + 3? [/INST] 5 </s>"
        "<s>[INST] And 3 + 4? [/INST]")
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids[1] != 1  # one bos, not two


def test_tokenizer_smaller_than_model_vocab(tmp_path):
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(tmp_path / "m", family="qwen2", vocab_size=1000,
                                tokenizer_vocab_size=400)
    assert len(AutoTokenizer.from_pretrained(model_dir)) == 400
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 1000


def test_deterministic_and_seeded(tmp_path):
    a = _load_tensors(make_tiny_model(tmp_path / "a", family="qwen2", seed=3))
    b = _load_tensors(make_tiny_model(tmp_path / "b", family="qwen2", seed=3))
    torch.manual_seed(123)
    c = _load_tensors(make_tiny_model(tmp_path / "c", family="qwen2", seed=4))
    after_build = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after_build)  # the caller's RNG stream is untouched
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise
        assert not torch.equal(a[name], c[name]), name


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    whole = make_tiny_model(tmp_path / "whole", family="qwen2")
    sharded = make_tiny_model(tmp_path / "sharded", family="qwen2", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    expected = _load_tensors(whole)
    assert sorted(index["weight_map"]) == sorted(expected)
    got = _load_tensors(sharded)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    model = AutoModelForCausalLM.from_pretrained(sharded)  # HF reads the index
    assert torch.equal(model.lm_head.weight, expected["lm_head.weight"])


def test_bfloat16_and_cli(tmp_path):
    main(["--family", "llama", "--output_dir", str(tmp_path / "m"), "--dtype", "bfloat16",
          "--num_layers", "3", "--hidden_size", "96", "--num_attention_heads", "6",
          "--num_key_value_heads", "3", "--intermediate_size", "160", "--vocab_size", "777",
          "--tie_word_embeddings", "--seed", "7", "--max_position_embeddings", "128"])
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"],
            cfg["tie_word_embeddings"], cfg["max_position_embeddings"]) == (
        3, 96, 6, 3, 160, 777, True, 128)
    tensors = _load_tensors(tmp_path / "m")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (3 * 16, 96)
    assert "lm_head.weight" not in tensors


@pytest.mark.parametrize("kwargs, message", [
    (dict(family="gpt2"), "family='gpt2'"),
    (dict(dtype="int8"), "dtype='int8'"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(hidden_size=64, num_attention_heads=5), "num_attention_heads=5"),
    (dict(family="qwen2", head_dim=32), "head_dim=32"),
    (dict(vocab_size=200), "vocab_size=200"),
    (dict(vocab_size=500, tokenizer_vocab_size=600), "tokenizer_vocab_size=600"),
])
def test_bad_arguments(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make_tiny_model(tmp_path / "m", **kwargs)


# vLLM loading a tiny Qwen2 of this tool (hidden 128, vocab 999) with HF's log-probs is
# tests/test_rollout_colocate.py's first check (sampled and prompt log-probs against HF
# transformers); every vLLM test loads one of this tool's checkpoints.
