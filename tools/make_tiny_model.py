"""Write a tiny Hugging Face causal-LM checkpoint for tests: seeded random weights
and a tokenizer trained locally (no downloads).

Families and what each writes next to ``config.json`` / ``*.safetensors``:

- ``qwen2`` / ``qwen3``: a byte-level BPE ``tokenizer.json`` (trained with the
  ``tokenizers`` library, Qwen's pre-tokenizer split, special tokens
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` appended after the BPE
  vocabulary as Qwen does) and a ChatML chat template. eos is ``<|im_end|>``,
  pad is ``<|endoftext|>``, no bos token (as in Qwen2.5/Qwen3 instruct).
- ``llama``: a sentencepiece BPE ``tokenizer.model`` with byte fallback
  (``<unk>``=0, ``<s>``=1, ``</s>``=2, as Llama 1/2), the ``tokenizer.json``
  transformers converts it to, and a Llama-2 style ``[INST]`` chat template.
  Like Llama, it has no pad token.

Simplifications made on purpose:

- The tokenizer corpus is generated in code (arithmetic, countdown prompts,
  short English sentences, digit strings, ``<think>``/``<answer>`` tags), so the
  tokenizer is small: its vocabulary holds at most ``tokenizer_vocab_size``
  tokens (default: ``vocab_size``; fewer when the corpus has no more merges).
  The model's ``vocab_size`` may be larger, like Qwen's padded vocabulary; ids
  past the tokenizer are "dead" rows the model can still score and sample.
- A full-size tokenizer (qwen families): ``tokenizer_corpus_words=N`` adds N distinct
  generated pseudo-words (syllables, with numbers and arithmetic between them) to the
  corpus, so the byte-level BPE finds merges up to a real vocabulary's size: 10,000
  words give ~31,000 tokens, 80,000 reach Qwen's 151,936 (4-12 s of training on 2
  cores, idle to loaded; ~0.45 GB).
  A random model over such a vocabulary samples like a real-size one (a softmax over
  150k rows, detokenizing 150k pieces), which a ~900-token tokenizer does not show.
- ``added_tokens`` (e.g. ``("<tool_call>", "</tool_call>")``, as Qwen2.5 has them) are
  regular added tokens after the special ones: each is one token, and decoding with
  ``skip_special_tokens`` keeps them. A random model writes a single token now and then,
  where it would almost never spell out a multi-token marker (the multi-turn learning
  tests rely on it).
- Weights are not HF's init: every tensor is drawn from its own generator
  seeded by ``(seed, parameter name)``, at a scale that keeps every part of
  the network visible in the logits (see ``_init_tensor``), so tests that
  compare logits across implementations can fail.

Usage:
    python tools/make_tiny_model.py --family qwen2 --output_dir /tmp/tiny-qwen2
    from tools.make_tiny_model import make_tiny_model
    path = make_tiny_model(tmp_path / "m", family="qwen3", head_dim=32)
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import pathlib
import random
import tempfile
import zlib

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# MoE families: sizes of the sparse block (make_tiny_model's `moe=` overrides them).
MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    norm_topk_prob=True)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Qwen's special tokens, in Qwen's order (ids follow the BPE vocabulary).
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split: contractions, letter runs, single digits (one
# token per digit, which matters for arithmetic), punctuation runs, newlines.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Byte-level BPE: 256 byte symbols + 3 specials; sentencepiece with byte
# fallback: 3 specials + 256 byte pieces + the corpus characters (~70). Below
# these a tokenizer cannot be built.
MIN_TOKENIZER_VOCAB = {"qwen2": 259 + 16, "qwen3": 259 + 16, "llama": 384,
                       "qwen2_moe": 259 + 16, "qwen3_moe": 259 + 16}

# ChatML, as Qwen2.5/Qwen3 use it. For qwen3, `enable_thinking=False` opens the
# assistant turn with an empty think block, as Qwen3's template does.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# Llama-2 chat: an optional system block folded into the first user turn,
# `<s>[INST] user [/INST] assistant </s>` per exchange. The prompt already ends
# ready for the assistant, so add_generation_prompt adds nothing.
LLAMA_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first %}{%- set content = system + message['content'] %}"
    "{%- else %}{%- set content = message['content'] %}{%- endif %}"
    "{{- bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{%- else %}"
    "{{- raise_exception('Only user and assistant roles are supported after the system message') }}"
    "{%- endif %}"
    "{%- endfor %}"
)


# --------------------------------------------------------------------------- corpus
_NOUNS = (
    "cat dog bird fish apple orange number answer question student teacher book river tree "
    "house car train problem equation sum product result value list table window city road "
    "garden friend family child water music letter paper pencil minute hour day week month "
    "year game team score point line circle square triangle angle side total price money "
    "coin box bag cup plate shop market school class lesson test step method idea reason"
).split()
_VERBS = (
    "sees likes finds adds counts reads writes solves checks computes takes makes gives "
    "needs wants buys sells opens closes builds draws moves holds keeps shows tells "
    "divides multiplies subtracts compares explains remembers"
).split()
_ADJS = (
    "small big red blue quick slow happy green old new first last simple correct "
    "large short long bright dark warm cold early late easy hard even odd whole"
).split()
_NAMES = "Alice Bob Carol David Emma Frank Grace Henry Ivy Jack Kate Liam Mia Noah".split()


def _corpus(seed: int = 0, num_lines: int = 3000) -> list[str]:
    """Deterministic training text shaped like the project's GRPO prompts."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        kind = i % 7
        if kind == 0:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            lines.append(f"What is {a} {op} {b}? The answer is {value}.")
        elif kind == 1:
            nums = [rng.randint(1, 100) for _ in range(rng.randint(3, 5))]
            lines.append(
                f"Using the numbers {nums}, create an equation that equals {rng.randint(1, 200)}. "
                "You can use basic arithmetic operations (+, -, *, /) and each number can only "
                "be used once. Show your work in <think> </think> tags. And return the final "
                "answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
            )
        elif kind == 2:
            a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99)
            lines.append(
                f"<think>\nFirst, {a} + {b} = {a + b}. Then {a + b} * {c} = {(a + b) * c}.\n"
                f"</think>\n<answer>({a} + {b}) * {c}</answer>"
            )
        elif kind == 3:
            lines.append(
                f"The {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
                f"{rng.choice(_ADJS)} {rng.choice(_NOUNS)}."
            )
        elif kind == 4:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)))
        elif kind == 5:
            name = rng.choice(_NAMES)
            n, k = rng.randint(2, 40), rng.randint(2, 9)
            lines.append(
                f"{name} has {n} {rng.choice(_NOUNS)}s and {rng.choice(_VERBS)} {k} more. "
                f"How many does {name} have? {name} has {n + k}. It's {rng.choice(_ADJS)}, "
                f"isn't it? We'll check: {n} + {k} = {n + k}."
            )
        else:
            x, a, b = rng.randint(1, 30), rng.randint(1, 20), rng.randint(1, 50)
            lines.append(
                f"Q: Solve {a}x + {b} = {a * x + b}. Let's think step by step. "
                f"The final answer is \\boxed{{{x}}}."
            )
    return lines


# Pseudo-word syllables (tokenizer_corpus_words): onset + vowel + optional coda.
_ONSETS = ("b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr bl cl fl gl pl sl st "
           "sp sk sm sn sw ch sh th wh qu str spr").split()
_VOWELS = "a e i o u y ai ea ee oo ou ie io ue au".split()
_CODAS = ("",) * 6 + tuple("n r s t l m nd st nt rk ck ng sh th x".split())


def _pseudo_word_corpus(num_words: int, seed: int = 0) -> list[str]:
    """`num_words` distinct pseudo-words of 1-4 syllables (a fifth capitalised), 12 to a
    line, with a number or a sum now and then and a closing punctuation mark.

    Distinct words are what a BPE needs to keep merging (each merge needs a pair that is
    not yet one token); a corpus of real-looking sentences from a few hundred words runs
    out of merges below a thousand tokens. Numbers add no merges (Qwen's split keeps one
    digit per token) but put digits and operators between words as in the prompts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    words = []
    while len(words) < num_words:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
        if word not in seen:
            seen.add(word)
            words.append(word.capitalize() if rng.random() < 0.2 else word)
    lines = []
    for i in range(0, num_words, 12):
        line = words[i:i + 12]
        if rng.random() < 0.3:
            a, b = rng.randint(0, 999), rng.randint(0, 99)
            line.insert(rng.randint(0, len(line)), rng.choice((str(a), f"{a} + {b} = {a + b}")))
        lines.append(" ".join(line) + rng.choice(".,?!;:"))
    return lines


# --------------------------------------------------------------------------- tokenizers
def _train_qwen_tokenizer(vocab_size: int, added_tokens: tuple[str, ...] = (),
                          corpus_words: int = 0):
    """Byte-level BPE shaped like Qwen2's tokenizer.json; returns a `tokenizers.Tokenizer`
    of at most `vocab_size` tokens, `added_tokens` included. `corpus_words` > 0 adds that
    many pseudo-words to the corpus (`_pseudo_word_corpus`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(QWEN_SPECIAL_TOKENS) - len(added_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    corpus = _corpus() + (_pseudo_word_corpus(corpus_words) if corpus_words else [])
    tok.train_from_iterator(corpus, trainer)
    # Added after training so that they take the last ids, as in Qwen's vocab.
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    tok.add_tokens(list(added_tokens))
    return tok


def _train_sentencepiece(vocab_size: int) -> bytes:
    """A Llama-style sentencepiece BPE model (serialized proto)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=out,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,  # no <unk> for unseen characters, as Llama
        split_digits=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        hard_vocab_limit=False,  # a small corpus may support fewer pieces
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


@functools.lru_cache(maxsize=32)
def _tokenizer_files(family: str, vocab_size: int, model_max_length: int,
                     added_tokens: tuple[str, ...] = (),
                     corpus_words: int = 0) -> tuple[tuple[str, bytes], ...]:
    """Train and save the tokenizer once per process; returns (file name, bytes) pairs.

    Training is the slow part of building a model (~0.1-0.5 s), and tests build many models.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "out"
        if family in ("qwen2", "qwen3"):
            hf_tok = PreTrainedTokenizerFast(
                tokenizer_object=_train_qwen_tokenizer(vocab_size, added_tokens, corpus_words),
                eos_token="<|im_end|>",
                pad_token="<|endoftext|>",
                bos_token=None,
                unk_token=None,
                model_max_length=model_max_length,
                clean_up_tokenization_spaces=False,
                chat_template=CHATML_TEMPLATE,
            )
            hf_tok.save_pretrained(out)
            # Name Qwen's class so AutoTokenizer resolves it as for a real Qwen checkpoint.
            config_path = out / "tokenizer_config.json"
            tok_config = json.loads(config_path.read_text())
            tok_config["tokenizer_class"] = "Qwen2Tokenizer"
            config_path.write_text(json.dumps(tok_config, indent=2))
        else:
            src = pathlib.Path(tmp) / "src"
            src.mkdir()
            (src / "tokenizer.model").write_bytes(_train_sentencepiece(vocab_size - len(added_tokens)))
            (src / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False, "legacy": False,
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
                "chat_template": LLAMA_TEMPLATE,
            }))
            # transformers converts the sentencepiece model into a fast tokenizer.json.
            llama_tok = AutoTokenizer.from_pretrained(src)
            llama_tok.add_tokens(list(added_tokens))
            llama_tok.save_pretrained(out)
            # Drop the loading-context keys from_pretrained leaves in the saved config.
            config_path = out / "tokenizer_config.json"
            tok_config = json.loads(config_path.read_text())
            for key in ("is_local", "local_files_only"):
                tok_config.pop(key, None)
            config_path.write_text(json.dumps(tok_config, indent=2))
            (out / "tokenizer.model").write_bytes((src / "tokenizer.model").read_bytes())
        return tuple(sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file()))


# --------------------------------------------------------------------------- weights
def _init_tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """A float32 tensor for parameter `name`, drawn from a generator seeded by (seed, name).

    Seeding per name makes each tensor independent of construction order, so two
    models that differ only in, e.g., tie_word_embeddings share all other weights.
    Scales: matrices N(0, 1/fan_in) (embeddings: 1/hidden) so q.k scores, MLP
    activations and logits are O(1) (with HF's std 0.02 attention is nearly uniform
    and a RoPE or mask bug changes logits by less than test tolerances); norm
    weights 1 + 0.1 N(0, 1) so a dropped or misplaced norm shows; biases N(0, 0.2^2).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.2 * noise
    fan_in = shape[-1]  # [out, in] for linears; [vocab, hidden] for embeddings
    return noise / math.sqrt(fan_in)


@contextlib.contextmanager
def _quiet_progress_bars():
    """Turn transformers' progress bars off for the block, then restore the setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _hf_config(family: str, dims: dict, token_ids: dict, moe: dict | None = None):
    """The transformers config object for `family` (`moe`: the sparse block's sizes)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        dims,
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=True,
        **token_ids,
    )
    if family == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if family == "qwen2":
        common.pop("head_dim")  # Qwen2 derives it as hidden_size // num_attention_heads
        return Qwen2Config(use_sliding_window=False, **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(attention_bias=False, use_sliding_window=False,
                              decoder_sparse_step=1, mlp_only_layers=[], **common,
                              **{**MOE_DEFAULTS, **(moe or {})})
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        common.pop("head_dim")
        sizes = {**MOE_DEFAULTS, "norm_topk_prob": False, "shared_expert_intermediate_size": 48,
                 **(moe or {})}
        return Qwen2MoeConfig(use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
                              qkv_bias=True, **common, **sizes)
    return Qwen3Config(attention_bias=False, use_sliding_window=False, **common)


def _check_args(family, num_layers, hidden_size, num_attention_heads, num_key_value_heads,
                intermediate_size, vocab_size, head_dim, dtype, tokenizer_vocab_size,
                tokenizer_corpus_words=0):
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not supported; choose one of {FAMILIES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {tuple(DTYPES)}")
    for option, value in (("num_layers", num_layers), ("hidden_size", hidden_size),
                          ("num_attention_heads", num_attention_heads),
                          ("num_key_value_heads", num_key_value_heads),
                          ("intermediate_size", intermediate_size)):
        if value < 1:
            raise ValueError(f"{option}={value} must be a positive integer")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_key_value_heads={num_key_value_heads} must divide "
            f"num_attention_heads={num_attention_heads}")
    if head_dim is None and hidden_size % num_attention_heads:
        raise ValueError(
            f"num_attention_heads={num_attention_heads} must divide hidden_size={hidden_size} "
            "(or pass head_dim explicitly for llama/qwen3)")
    if family in ("qwen2", "qwen2_moe") and head_dim is not None and head_dim * num_attention_heads != hidden_size:
        raise ValueError(
            f"head_dim={head_dim} is not supported for family='qwen2': Qwen2 uses "
            f"hidden_size // num_attention_heads = {hidden_size // num_attention_heads}; "
            "use family='qwen3' or 'llama' for an explicit head_dim")
    tok_vocab = vocab_size if tokenizer_vocab_size is None else tokenizer_vocab_size
    if tok_vocab < MIN_TOKENIZER_VOCAB[family]:
        raise ValueError(
            f"vocab_size={vocab_size} (tokenizer_vocab_size={tokenizer_vocab_size}) is too small: "
            f"the {family} tokenizer needs at least {MIN_TOKENIZER_VOCAB[family]} tokens")
    if tok_vocab > vocab_size:
        raise ValueError(
            f"tokenizer_vocab_size={tokenizer_vocab_size} must be <= vocab_size={vocab_size}")
    if tokenizer_corpus_words < 0:
        raise ValueError(f"tokenizer_corpus_words={tokenizer_corpus_words} must be >= 0 "
                         "(0: the built-in corpus only)")
    if tokenizer_corpus_words and family == "llama":
        raise ValueError(
            f"tokenizer_corpus_words={tokenizer_corpus_words} is for the byte-level BPE of the "
            "qwen families; family='llama' trains its sentencepiece on the built-in corpus only "
            "(pass tokenizer_corpus_words=0)")


def make_tiny_model(
    out_dir,
    family: str = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 1000,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    max_shard_size: str | int | None = None,
    rms_norm_eps: float = 1e-6,
    tokenizer_vocab_size: int | None = None,
    moe: dict | None = None,
    added_tokens: tuple[str, ...] = (),
    tokenizer_corpus_words: int = 0,
) -> pathlib.Path:
    """Write a tiny HF checkpoint of `family` into `out_dir` and return its path.

    `vocab_size` is the model's embedding rows (any size, e.g. 999); the tokenizer is
    trained for `tokenizer_vocab_size` tokens (default `vocab_size`), and holds fewer
    when the built-in corpus supports no more merges (at most 896 tokens for
    qwen2/qwen3, 1631 for llama). `max_shard_size` (e.g. "200KB") splits the
    safetensors into shards with an index. Same arguments give bitwise-identical tensors.

    vLLM's CPU attention only supports head_dim in {32, 64, 80, 96, ...}: the default
    64 hidden / 4 heads (head_dim 16) is fine for HF and Megatron but not for a vLLM
    engine; use e.g. hidden_size=128 there. `added_tokens`: regular (not special)
    tokens added after the special ones, one id each (module docstring).
    `tokenizer_corpus_words` (qwen families): train the BPE on that many generated
    pseudo-words besides the built-in corpus, for a tokenizer of real size (module
    docstring); 0, the default, leaves every output as it was.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    _check_args(family, num_layers, hidden_size, num_attention_heads, num_key_value_heads,
                intermediate_size, vocab_size, head_dim, dtype, tokenizer_vocab_size,
                tokenizer_corpus_words)
    if (vocab_size if tokenizer_vocab_size is None else tokenizer_vocab_size) - len(added_tokens) \
            < MIN_TOKENIZER_VOCAB[family]:
        raise ValueError(f"added_tokens={tuple(added_tokens)} leave the {family} tokenizer fewer "
                         f"than {MIN_TOKENIZER_VOCAB[family]} tokens; raise vocab_size")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # Tokenizer first: its special-token ids go into config.json / generation_config.json.
    tok_vocab = vocab_size if tokenizer_vocab_size is None else tokenizer_vocab_size
    tok_family = "llama" if family == "llama" else "qwen3"  # Qwen tokenizers are one kind
    for name, data in _tokenizer_files(tok_family, tok_vocab, max_position_embeddings,
                                       tuple(added_tokens), tokenizer_corpus_words):
        (out_dir / name).write_bytes(data)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())
    token_id = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    if family == "llama":
        token_ids = dict(bos_token_id=token_id["<s>"], eos_token_id=token_id["</s>"], pad_token_id=None)
        gen_eos = token_id["</s>"]
    else:
        # Qwen instruct: config bos is <|endoftext|>, eos <|im_end|>; generation
        # stops at either.
        token_ids = dict(bos_token_id=token_id["<|endoftext|>"], eos_token_id=token_id["<|im_end|>"],
                         pad_token_id=token_id["<|endoftext|>"])
        gen_eos = [token_id["<|im_end|>"], token_id["<|endoftext|>"]]

    dims = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tie_word_embeddings,
    )
    config = _hf_config(family, dims, token_ids, moe)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]

    torch_dtype = DTYPES[dtype]
    # HF's own init draws from the global RNG; fork it so callers' seeded streams
    # are not shifted by building a model (our weights come from _init_tensor).
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # named_parameters() lists a tied lm_head once (as embed_tokens).
        for name, param in model.named_parameters():
            param.copy_(_init_tensor(name, param.shape, seed))
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["bos_token_id"], eos_token_id=gen_eos,
        pad_token_id=token_ids["pad_token_id"])
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    with _quiet_progress_bars():  # "Writing model shards" would fill test logs
        model.save_pretrained(out_dir, **save_kwargs)

    # Older readers (and some converters) look for `torch_dtype` and a top-level
    # `rope_theta`; transformers 5 writes `dtype` and `rope_parameters`. Keep both.
    config_path = out_dir / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["dtype"] = dtype
    config_json["torch_dtype"] = dtype
    config_json["rope_theta"] = float(rope_theta)
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return out_dir


def make_tiny_reward_model(out_dir, tokenizer_from, *, hidden_size: int = 64,
                           num_layers: int = 2, seed: int = 0,
                           num_key_value_heads: int = 2) -> pathlib.Path:
    """A tiny output reward model: Qwen2ForSequenceClassification with one label and random
    weights, written by the installed transformers' save_pretrained, with the tokenizer
    (and chat template) of the HF folder `tokenizer_from`."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    src = pathlib.Path(tokenizer_from)
    with open(src / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                         intermediate_size=2 * hidden_size, max_position_embeddings=512,
                         num_labels=1)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config).eval()
    out = pathlib.Path(out_dir)
    model.save_pretrained(out)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(src / name, out / name)
    return out


def make_digit_reward_model(out_dir, tokenizer_from, *, seed: int = 0) -> pathlib.Path:
    """A tiny output reward model that scores the share of digits in a conversation, for
    a GRPO run that learns from a reward model (configs/quickstart_rm_cpu.yaml).

    Qwen2ForSequenceClassification, one layer, its weights set by hand: every token
    holding a digit has its embedding pushed along one direction u; attention with zero
    queries and keys averages the (normalised) embeddings of the whole conversation
    (uniform causal attention: the last token sees the mean of all), the MLP adds nothing,
    and the score head reads u. The score rises with the share of digit tokens, from
    about 0 (none) towards 1. Tokenizer and chat template: those of `tokenizer_from`."""
    import torch
    from transformers import AutoTokenizer

    out = make_tiny_reward_model(out_dir, tokenizer_from, hidden_size=64, num_layers=1,
                                 seed=seed, num_key_value_heads=4)
    from transformers import Qwen2ForSequenceClassification

    model = Qwen2ForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(hidden, generator=gen)
    u /= u.norm()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(0.02 * torch.randn(emb.shape, generator=gen))
        digits = [i for i in range(min(len(tok), emb.shape[0]))
                  if any(c.isdigit() for c in tok.decode([i]))]
        emb[digits] += 0.5 * u
        layer = model.model.layers[0]
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.zero_()
            proj.bias.zero_()
        attn.v_proj.weight.copy_(torch.eye(hidden))
        attn.v_proj.bias.zero_()
        attn.o_proj.weight.copy_(10 * torch.eye(hidden))
        layer.mlp.down_proj.weight.zero_()
        model.score.weight.copy_(u.unsqueeze(0) / 8)     # RMSNorm leaves a norm of 8
    model.save_pretrained(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True, help="folder to write the checkpoint into")
    parser.add_argument("--family", default="qwen2", choices=FAMILIES)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_attention_heads", type=int, default=4)
    parser.add_argument("--num_key_value_heads", type=int, default=2)
    parser.add_argument("--intermediate_size", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=1000)
    parser.add_argument("--head_dim", type=int, default=None)
    parser.add_argument("--tie_word_embeddings", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_position_embeddings", type=int, default=512)
    parser.add_argument("--rope_theta", type=float, default=10000.0)
    parser.add_argument("--max_shard_size", default=None, help='e.g. "200KB": write sharded safetensors')
    parser.add_argument("--rms_norm_eps", type=float, default=1e-6)
    parser.add_argument("--tokenizer_vocab_size", type=int, default=None,
                        help="tokens the tokenizer is trained for (default: vocab_size)")
    parser.add_argument("--added_tokens", nargs="*", default=(),
                        help="regular added tokens, one id each, e.g. '<tool_call>' '</tool_call>'")
    parser.add_argument("--tokenizer_corpus_words", type=int, default=0,
                        help="qwen families: train the BPE on this many generated pseudo-words "
                             "too (80000: a 151,936-token tokenizer); 0: the built-in corpus only")
    args = vars(parser.parse_args(argv))
    if args["max_shard_size"] is not None and args["max_shard_size"].isdigit():
        args["max_shard_size"] = int(args["max_shard_size"])  # bytes
    args["added_tokens"] = tuple(args["added_tokens"])
    path = make_tiny_model(args.pop("output_dir"), **args)
    print(path)


if __name__ == "__main__":
    main()
