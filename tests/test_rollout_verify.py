"""Fingerprint math and the HF-checkpoint stream, without vLLM (fast).

The fingerprint hashes are checked against a reference computed here element by
element with Python integers from the definition (float32 bits, index hashes,
mod 2**31 - 1), and the properties the sync check relies on: pieces of a tensor
(row or column slices, as vLLM's TP shards and fused q/k/v blocks are) add up to
the whole exactly, while one changed ulp, swapped rows or a transposed matrix
change the fingerprint.
"""
from __future__ import annotations

import struct

import pytest
import torch

from megatron_grpo.rollout.buckets import iter_safetensors_buckets, perturb_buckets, save_hf_copy
from megatron_grpo.rollout.verify import (StreamFingerprints, WeightSyncError, _differs,
                                          _index_weights, check_weight_sync, combine_pieces,
                                          compare_fingerprints, fingerprint, fingerprint_piece)
from tools.make_tiny_model import make_tiny_model

P = 2**31 - 1


def _reference(x: torch.Tensor) -> dict:
    """The definition with Python integers, one element at a time."""
    vals = x.to(torch.float32).reshape(-1).tolist()
    h1 = h2 = 0
    for i, v in enumerate(vals):
        bits = struct.unpack("<I", struct.pack("<f", v + 0.0))[0] % P
        w1, w2 = (int(_index_weights(torch.tensor([i]), salt)) for salt in (0, 1))
        h1, h2 = (h1 + bits * w1) % P, (h2 + bits * w2) % P
    return dict(numel=len(vals), h1=h1, h2=h2)


def _same(a, b) -> bool:
    return not _differs(a, b)


def _piece_dict(name, x_full, dim, start, length):
    fp = fingerprint_piece(x_full.narrow(dim, start, length), x_full.shape, dim, start)
    return dict(name=name, full_shape=list(x_full.shape), dim=dim, start=start, length=length, **fp)


def test_index_weights_match_their_formula():
    i = torch.tensor([0, 1, 2, 12345, P - 1, P, 3 * P + 7])
    for salt, (a, b, c) in enumerate(((48271, 16807, 1234567), (69621, 40692, 7654321))):
        expect = [((((k % P) * a + (k // P) * b + c) % P) ** 2 + c) % P for k in i.tolist()]
        assert _index_weights(i, salt).tolist() == expect
    w = _index_weights(torch.arange(100_000))
    assert len(set(w.tolist())) > 99_000  # (almost) no two positions weigh the same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_matches_definition_and_pieces_add_up(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 10, generator=gen).to(dtype)
    x[0, 0] = -0.0  # counts as +0.0
    full = fingerprint(x)
    assert _same(full, _reference(x))
    assert abs(full["sum"] - x.double().sum().item()) < 1e-9
    # Row blocks (column-parallel shards, q/k/v) and column blocks (row-parallel shards).
    for dim, cuts in ((0, [0, 8, 12, 24]), (1, [0, 3, 10])):
        pieces = [fingerprint_piece(x.narrow(dim, a, b - a), x.shape, dim, a)
                  for a, b in zip(cuts[:-1], cuts[1:])]
        held, problems = combine_pieces(
            [dict(name="x", full_shape=list(x.shape), dim=dim, start=a, length=b - a, **fp)
             for (a, b), fp in zip(zip(cuts[:-1], cuts[1:]), pieces)])
        assert problems == [] and _same(held["x"], full), dim
    # A 1-D tensor and a scalar.
    v = torch.randn(7, generator=gen)
    assert _same(fingerprint(v), _reference(v))
    assert _same(fingerprint(torch.tensor(2.0)), _reference(torch.tensor([2.0])))


def test_fingerprint_sees_one_ulp_and_positions():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 256, generator=gen)
    full = fingerprint(x)
    one = x.clone()
    one[100, 3] = torch.nextafter(one[100, 3], torch.tensor(10.0))  # one float32 ulp
    assert _differs(fingerprint(one), full) == ["h1", "h2"]
    swapped = x[[1, 0, *range(2, 512)]]
    assert _differs(fingerprint(swapped), full) == ["h1", "h2"]
    square = torch.randn(64, 64, generator=gen)
    assert _differs(fingerprint(square.t().contiguous()), fingerprint(square)) == ["h1", "h2"]
    # A bf16 stream fingerprinted as the float32 values vLLM would hold: identical.
    assert _same(fingerprint(x.bfloat16()), fingerprint(x.bfloat16().float()))


def test_combine_pieces_counts_replicas_once_and_checks_tiling():
    gen = torch.Generator().manual_seed(2)
    q, norm = torch.randn(8, 4, generator=gen), torch.randn(4, generator=gen)
    # Two TP ranks: q split by rows, the norm replicated on both.
    pieces = [_piece_dict("q", q, 0, 0, 4), _piece_dict("q", q, 0, 4, 4),
              _piece_dict("norm", norm, 0, 0, 4), _piece_dict("norm", norm, 0, 0, 4)]
    held, problems = combine_pieces(pieces)
    assert problems == []
    assert _same(held["q"], fingerprint(q)) and _same(held["norm"], fingerprint(norm))

    bad_replica = _piece_dict("norm", norm * 2, 0, 0, 4)
    _, problems = combine_pieces(pieces[:3] + [bad_replica])
    assert len(problems) == 1 and problems[0].startswith("norm: replicas on vLLM TP ranks differ")
    _, problems = combine_pieces(pieces[:1] + pieces[2:])  # half of q missing
    assert len(problems) == 1 and problems[0].startswith("q: vLLM's slices do not tile")


def test_compare_names_every_problem():
    a, b, c = (torch.full((3,), float(v)) for v in (1, 2, 3))
    b = torch.tensor([1.0, 2.0, 3.0])
    expected = {"a": fingerprint(a), "b": fingerprint(b), "sent_only": fingerprint(c)}
    held = {"a": fingerprint(a), "b": fingerprint(b + 0.5), "held_only": fingerprint(c)}
    problems = compare_fingerprints(expected, held)
    assert len(problems) == 3
    assert problems[0] == "b: differs in vLLM (bits differ; sum trainer=6 vllm=7.5)"
    assert problems[1] == "sent_only: sent by the trainer but vLLM holds no such tensor"
    assert problems[2] == "held_only: held by vLLM but absent from the trainer's stream (not updated)"
    nan = fingerprint(torch.tensor([1.0, float("nan"), 2.0]))
    assert compare_fingerprints({"b": fingerprint(b)}, {"b": nan}) == [
        "b: differs in vLLM (bits differ; sum trainer=6 vllm=nan)"]


class _FakeEngine:
    """Stands in for vLLM's side only: pieces as workers would report them."""

    def __init__(self, tensors, tp=2):
        self.pieces = []
        for name, t in tensors.items():
            step = t.shape[0] // tp
            self.pieces += [_piece_dict(name, t, 0, r * step, step) for r in range(tp)]

    def weight_fingerprints(self):
        return [self.pieces, self.pieces]  # two DP replicas


def test_check_weight_sync_with_tied_embeddings_and_replicas():
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(6, 4, generator=gen)
    engine = _FakeEngine({"model.embed_tokens.weight": emb})
    expected = StreamFingerprints()
    list(expected.watch([[("model.embed_tokens.weight", emb), ("lm_head.weight", emb)]]))
    assert check_weight_sync(engine, expected.result) == 2   # lm_head checked against embed
    expected.result["lm_head.weight"] = fingerprint(emb + 1)
    with pytest.raises(WeightSyncError, match=r"vLLM engine 1: lm_head.weight: differs in vLLM"):
        check_weight_sync(engine, expected.result)
    with pytest.raises(WeightSyncError, match="carries 'x' twice"):
        list(StreamFingerprints().watch([[("x", emb)], [("x", emb)]]))


def test_check_weight_sync_vision_language_names_and_frozen_tower():
    """A VL model: vLLM's own names (vllm_aliases) read back as the checkpoint's, and a
    frozen tower vLLM holds but the sync filter left out is not "absent from the stream";
    a streamed tensor the filter keeps is still required."""
    from bridge.mappings import get_mapping
    from bridge.mappings.vision import sync_filter

    gen = torch.Generator().manual_seed(4)
    layer, head, tower, merger = (torch.randn(4, 2, generator=gen) for _ in range(4))
    engine = _FakeEngine({"language_model.model.layers.0.mlp.down_proj.weight": layer,
                          "language_model.lm_head.weight": head,
                          "visual.blocks.0.mlp.up_proj.weight": tower,
                          "visual.merger.mlp.0.weight": merger})
    aliases = get_mapping("qwen2_5_vl").vllm_aliases
    include = sync_filter(freeze_vit=True, freeze_aligner=False)
    expected = {"model.layers.0.mlp.down_proj.weight": fingerprint(layer),
                "lm_head.weight": fingerprint(head), "visual.merger.mlp.0.weight": fingerprint(merger)}
    assert check_weight_sync(engine, expected, aliases, include) == 3
    with pytest.raises(WeightSyncError, match="visual.blocks.0.mlp.up_proj.weight: held by vLLM "
                                              "but absent"):
        check_weight_sync(engine, expected, aliases)                    # no filter given
    with pytest.raises(WeightSyncError, match="model.layers.0.mlp.down_proj.weight: sent by"):
        check_weight_sync(engine, expected, (), include)                # vLLM's names unread
    del expected["visual.merger.mlp.0.weight"]
    with pytest.raises(WeightSyncError, match="visual.merger.mlp.0.weight: held by vLLM"):
        check_weight_sync(engine, expected, aliases, include)           # trains: must stream


def test_safetensors_buckets_cover_the_checkpoint(tmp_path):
    # Sharded on disk (with an index), to read the way the bridge would find it.
    model = make_tiny_model(tmp_path / "m", num_layers=3, max_shard_size="20KB")
    assert (model / "model.safetensors.index.json").is_file()
    one = list(iter_safetensors_buckets(model))
    assert len(one) == 1
    names = [n for n, _ in one[0]]
    assert len(names) == len(set(names)) == 3 * 12 + 3  # 12 per qwen2 layer (q/k/v with biases) + embed, norm, head
    # Layer order: embeddings first, then layer 0, 1, 2, then the final norm and head.
    layer_of = [int(n.split(".")[2]) for n in names if ".layers." in n]
    assert layer_of == sorted(layer_of) and names[0] == "model.embed_tokens.weight"
    for k in (2, 5):
        buckets = list(iter_safetensors_buckets(model, num_buckets=k))
        assert len(buckets) in (k, k + 1) and [n for b in buckets for n, _ in b] == names
    per_tensor = list(iter_safetensors_buckets(model, bucket_bytes=1))
    assert [len(b) for b in per_tensor] == [1] * len(names)
    # A perturbed copy differs everywhere and reads back as written.
    copy = save_hf_copy(model, tmp_path / "copy", perturb_buckets(iter_safetensors_buckets(model)))
    again = dict(next(iter_safetensors_buckets(copy)))
    for name, t in one[0]:
        assert not torch.equal(again[name], t)
        assert torch.equal(again[name], dict(next(perturb_buckets([[(name, t)]])))[name])
    with pytest.raises(ValueError, match="num_buckets=0"):
        list(iter_safetensors_buckets(model, num_buckets=0))
