"""Single-process tests of the bridge's declarative mappings (bridge/mappings).

The layouts are checked against Megatron layouts built here independently, from
docs/architecture.md's description ("linear_qkv per query group [q heads of the group, k, v]",
"linear_fc1 = [gate_shard; up_shard] per TP rank", vocab padded then split), on tensors
whose every entry is distinct, so a misplaced row or a wrong replica fails.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge.load import check_checkpoint
from bridge.mappings import MAPPINGS, ModelDims, export_pieces, get_mapping
from bridge.mappings.layouts import FUSED_GATE_UP, FUSED_QKV, REPLICATED, ROW, VOCAB
from megatron_grpo.model import FAMILIES

H = 8  # hidden size of the toy tensors
# make_tiny_model builds the text families; the vision-language ones (tiny checkpoints from
# tools/make_tiny_vl_model.py) are checked in tests/test_vl_model.py.
TEXT_FAMILIES = sorted(f for f, family in FAMILIES.items() if not family.vision)


def _dims(tp, heads=4, kv=2, d=2, vocab=13, ffn=6):
    groups = max(kv, tp) if kv < tp else kv
    padded = -(-vocab // (4 * tp)) * 4 * tp  # any padding to a multiple of tp will do
    return ModelDims(hidden=H, ffn=ffn, heads=heads, kv_heads=kv, query_groups=groups,
                     head_dim=d, vocab=vocab, padded_vocab=padded, layers=1, tp=tp)


def _distinct(*shape, start=1):
    return torch.arange(start, start + torch.Size(shape).numel(), dtype=torch.float64).view(shape)


def _shard_from_pieces(layout, rank, dims, hf, shard_shape):
    """What load does: fill the shard from the HF tensors through the pieces."""
    shard = torch.full(shard_shape, float("nan"), dtype=torch.float64)
    pieces = layout.pieces(rank, dims, [t.shape for t in hf])
    covered = 0
    for p in pieces:
        src = hf[p.hf] if p.axis is None else hf[p.hf].narrow(p.axis, p.hf_start, p.hf_stop - p.hf_start)
        dst = shard if p.axis is None else shard.narrow(p.axis, p.shard_start, p.shard_stop - p.shard_start)
        dst.copy_(src)
        covered += p.shard_stop - p.shard_start
    return torch.nan_to_num(shard, nan=0.0)  # vocab padding rows: zero


def _hf_from_shards(layout, dims, hf_shapes, shards):
    """What export does: rebuild each HF tensor from the shards of all ranks."""
    out = []
    for j, shape in enumerate(hf_shapes):
        t = torch.full(shape, float("nan"), dtype=torch.float64)
        for rank, p in export_pieces(layout, j, dims, hf_shapes):
            src = shards[rank] if p.axis is None else \
                shards[rank].narrow(p.axis, p.shard_start, p.shard_stop - p.shard_start)
            dst = t if p.axis is None else t.narrow(p.axis, p.hf_start, p.hf_stop - p.hf_start)
            dst.copy_(src)
        out.append(t)
    return out


def _reference_qkv(q, k, v, dims):
    """Megatron's full fused tensor: per query group g [q heads of g, k of g's kv head, v]."""
    d, groups = dims.head_dim, dims.query_groups
    qpg = dims.heads // groups
    rest = q.shape[1:]
    qh, kh, vh = q.view(dims.heads, d, *rest), k.view(dims.kv_heads, d, *rest), v.view(dims.kv_heads, d, *rest)
    blocks = []
    for g in range(groups):
        kv = g * dims.kv_heads // groups  # query group g's kv head (replicated when groups > kv)
        blocks += [qh[g * qpg:(g + 1) * qpg].reshape(qpg * d, *rest), kh[kv], vh[kv]]
    return torch.cat(blocks)


QKV_CASES = [  # (tp, heads, kv): equal, more kv than tp, fewer kv than tp (replication)
    (1, 4, 2), (2, 4, 2), (2, 4, 4), (4, 8, 2), (2, 4, 1), (4, 4, 1), (4, 8, 4),
]


@pytest.mark.parametrize("tp,heads,kv", QKV_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_layout_matches_megatron_grouping(tp, heads, kv, bias):
    dims = _dims(tp, heads=heads, kv=kv)
    rest = () if bias else (H,)
    q = _distinct(dims.q_out, *rest)
    k = _distinct(dims.kv_out, *rest, start=10_000)
    v = _distinct(dims.kv_out, *rest, start=20_000)
    full = _reference_qkv(q, k, v, dims)
    shape = FUSED_QKV.shard_shape(dims, [q.shape, k.shape, v.shape])
    shards = [_shard_from_pieces(FUSED_QKV, r, dims, [q, k, v], shape) for r in range(tp)]
    for r in range(tp):
        assert torch.equal(shards[r], full.chunk(tp)[r]), f"rank {r}"
    back = _hf_from_shards(FUSED_QKV, dims, [q.shape, k.shape, v.shape], shards)
    for name, got, want in zip("qkv", back, (q, k, v)):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_row_vocab_and_replicated_layouts(tp):
    dims = _dims(tp, ffn=8, vocab=13)
    gate, up = _distinct(dims.ffn, H), _distinct(dims.ffn, H, start=1000)
    down = _distinct(H, dims.ffn, start=5000)
    embed = _distinct(dims.vocab, H, start=9000)
    norm = _distinct(H, start=7)
    padded = F.pad(embed, (0, 0, 0, dims.padded_vocab - dims.vocab))  # zero rows past the vocab
    cases = [
        (FUSED_GATE_UP, [gate, up], [torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]) for r in range(tp)]),
        (ROW, [down], list(down.chunk(tp, dim=1))),
        (VOCAB, [embed], list(padded.chunk(tp))),
        (REPLICATED, [norm], [norm] * tp),
    ]
    for layout, hf, want in cases:
        shapes = [t.shape for t in hf]
        shard_shape = layout.shard_shape(dims, shapes)
        shards = [_shard_from_pieces(layout, r, dims, hf, shard_shape) for r in range(tp)]
        for r in range(tp):
            assert torch.equal(shards[r], want[r]), (type(layout).__name__, r)
        for got, ref in zip(_hf_from_shards(layout, dims, shapes, shards), hf):
            assert torch.equal(got, ref), type(layout).__name__


def test_vocab_padding_can_leave_a_rank_without_rows():
    # 5 rows over 4 ranks padded to 8: ranks 0-2 hold 2, 2, 1 real rows, rank 3 none.
    dims = ModelDims(hidden=H, ffn=4, heads=4, kv_heads=4, query_groups=4, head_dim=2, vocab=5,
                     padded_vocab=8, layers=1, tp=4)
    assert [sum(p.shard_stop - p.shard_start for p in VOCAB.pieces(r, dims, [(5, H)]))
            for r in range(4)] == [2, 2, 1, 0]


def test_registry_covers_every_model_family():
    assert set(MAPPINGS) == set(FAMILIES)
    with pytest.raises(ValueError, match="supported families: .*llama.*qwen2.*qwen3"):
        get_mapping("mixtral")


def _config(path, **kw):
    from megatron_grpo.model import build_transformer_config

    return build_transformer_config(path, **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    out = {}
    for family in TEXT_FAMILIES:
        for tied in (False, True):
            path = tmp_path_factory.mktemp(f"{family}_{tied}")
            out[family, tied] = make_tiny_model(path, family=family, tie_word_embeddings=tied,
                                                vocab_size=999, num_key_value_heads=1)
    return out


@pytest.mark.parametrize("family", TEXT_FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_manifest_is_exactly_the_checkpoint(checkpoints, family, tied):
    from bridge import manifest
    from bridge.hf_checkpoint import HFCheckpoint

    path = checkpoints[family, tied]
    with HFCheckpoint(path) as ckpt:
        found = ckpt.shapes()
    for tp, pp in ((1, 1), (2, 2)):
        config, args = _config(path, tp=tp, pp=pp)
        assert manifest(config, args) == found
    assert ("lm_head.weight" in found) == (not tied)


def test_unknown_and_te_names(checkpoints):
    path = checkpoints["qwen3", False]
    config, args = _config(path, tp=2)
    mapping, dims = get_mapping("qwen3"), ModelDims.from_config(config, args)
    local = mapping.resolve("decoder.layers.1.input_layernorm.weight", config, args, dims)
    te = mapping.resolve("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", config, args, dims)
    assert local.hf_names == te.hf_names == ("model.layers.1.input_layernorm.weight",)
    te_mlp = mapping.resolve("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", config, args, dims)
    assert te_mlp.hf_names == ("model.layers.0.post_attention_layernorm.weight",)
    for bad in ("decoder.layers.0.self_attention.linear_qkv.lora_A.weight",
                "decoder.layers.7.mlp.linear_fc2.weight",  # only 2 layers
                "decoder.layers.0.self_attention.linear_qkv.bias"):  # qwen3 has no qkv bias
        with pytest.raises(ValueError, match="has no rule in the 'qwen3' bridge mapping"):
            mapping.resolve(bad, config, args, dims)


def test_check_checkpoint_lists_every_problem_at_once():
    expected = {"a": (2, 3), "b": (4,), "c": (1,)}
    found = {"a": (3, 2), "c": (1,), "zzz": (5,), "model.layers.0.self_attn.rotary_emb.inv_freq": (8,)}
    with pytest.raises(ValueError) as err:
        check_checkpoint(found, expected, optional=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))
    msg = str(err.value)
    assert "1 missing, 1 unexpected, 1 mis-shaped" in msg
    assert "missing tensors (1): b" in msg and "unexpected tensors (1): zzz" in msg
    assert "a expected (2, 3) found (3, 2)" in msg and "inv_freq" not in msg
    check_checkpoint({"a": (2, 3)}, {"a": (2, 3)})  # a match passes
