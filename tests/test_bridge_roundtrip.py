"""HF -> Megatron -> HF through the bridge, bit-exact, and HF-parity of the loaded model.

One 4-rank gloo world runs every parallel layout in turn (TP in {1, 2}, PP in {1, 2},
PP=2 x VPP=2; ranks left over are data-parallel replicas, which must receive the same
stream), its process groups set up once per layout (Megatron's set-up of a layout is most
of a round trip's cost here), on two checkpoints of each family:
- untied embeddings, 2 kv heads, sharded safetensors (with an index);
- tied embeddings, 1 kv head (fewer kv heads than TP: replicated on load, de-duplicated
  on export).
Both have 4 layers and a vocab of 999 (not a multiple of 128: padded, then trimmed).
Logits under TP=2 x PP=2 and TP=1 (Megatron's pipeline schedule, forward_only) are
compared with HF transformers' on the same ids.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import hf_tensors, run_distributed

FAMILIES = ("llama", "qwen2", "qwen3")
LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2), (2, 2, 2)]
LOGIT_LAYOUTS = [(2, 2, None), (1, 1, None)]
VOCAB = 999


def _world(rank, world_size, all_paths, ids):
    """Every layout in turn (its process groups set up once), and under each every
    checkpoint of every family: family -> (roundtrips, logits)."""
    from bridge.hf_checkpoint import HFCheckpoint
    from megatron_grpo.platform import ParallelDims, init_parallel

    bytes_read = []
    original_read = HFCheckpoint.read

    def counting_read(self, *a, **kw):  # how many bytes this rank reads from disk
        t = original_read(self, *a, **kw)
        bytes_read.append(t.numel() * t.element_size())
        return t

    HFCheckpoint.read = counting_read
    refs = {path: hf_tensors(path) for paths in all_paths.values() for path in paths.values()}
    out = {family: ([], {}) for family in all_paths}
    for tp, pp, vpp in LAYOUTS:
        init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp, vpp=vpp))
        for family, paths in all_paths.items():
            roundtrips, logits = out[family]
            for kind, path in paths.items():
                roundtrip, logit = _roundtrip(path, refs[path], (tp, pp, vpp), ids, bytes_read)
                roundtrips.append(dict(roundtrip, kind=kind))
                if logit is not None:
                    logits[kind, (tp, pp)] = logit
    return out


def _roundtrip(path, ref, layout, ids, bytes_read):
    """Load `path` into a model of `layout` (the process groups already set up), export
    it, and compare with `ref`; Megatron's logits for LOGIT_LAYOUTS, else None."""
    from bridge import export_hf_weights, load_hf_weights
    from bridge.params import global_params
    from megatron.core import parallel_state as ps
    from megatron_grpo.convert import megatron_logits
    from megatron_grpo.model import build_model, build_transformer_config

    tp, pp, vpp = layout
    config, args = build_transformer_config(path, tp=tp, pp=pp, vpp=vpp)
    chunks = build_model(config, args)
    for chunk in chunks:  # garbage first, so that a tensor the bridge skips shows
        for p in chunk.parameters():
            p.data.fill_(float("nan"))
    bytes_read.clear()
    load_hf_weights(chunks, config, args, path)
    local_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    no_nan = not any(torch.isnan(p).any() for c in chunks for p in c.parameters())
    pad_zero = True  # vocab rows past the HF vocab: zero
    for name, p in global_params(chunks):
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            first_row = ps.get_tensor_model_parallel_rank() * p.shape[0]
            pad_zero &= bool((p[max(0, VOCAB - first_row):] == 0).all())
    names, wrong = [], []
    for bucket in export_hf_weights(chunks, config, args, bucket_size_bytes=48 << 10,
                                    offload_bridge=vpp is not None):
        for name, tensor in bucket:
            names.append(name)
            if name not in ref or tensor.dtype != ref[name].dtype \
                    or not torch.equal(tensor, ref[name]):
                wrong.append(name)
        del bucket
    roundtrip = dict(layout=layout, names=names, wrong=wrong, expected=sorted(ref),
                     no_nan=no_nan, pad_zero=pad_zero, read=sum(bytes_read), local=local_bytes,
                     total=sum(t.numel() * t.element_size() for t in ref.values()))
    logits = megatron_logits(chunks, config, args, ids).cpu() if layout in LOGIT_LAYOUTS else None
    return roundtrip, logits


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    paths = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        paths[family] = {
            "untied_kv2_sharded": str(make_tiny_model(
                root / "untied", family=family, num_layers=4, num_key_value_heads=2,
                vocab_size=VOCAB, max_shard_size="60KB")),
            "tied_kv1": str(make_tiny_model(
                root / "tied", family=family, num_layers=4, num_key_value_heads=1,
                vocab_size=VOCAB, tie_word_embeddings=True, seed=1)),
        }
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    results = run_distributed(_world, world_size=4, args=(paths, ids), timeout=300)
    return paths, ids, results


@pytest.fixture(params=FAMILIES)
def family_world(request, world):
    paths, ids, results = world
    family = request.param
    return family, paths[family], ids, [r[family] for r in results]


def test_bridge_roundtrip_bit_exact(family_world):
    family, paths, _, results = family_world
    import os

    assert os.path.exists(os.path.join(paths["untied_kv2_sharded"], "model.safetensors.index.json"))
    for rank, (roundtrips, _) in enumerate(results):
        assert len(roundtrips) == 2 * len(LAYOUTS)
        for r in roundtrips:
            where = f"{family} {r['kind']} tp,pp,vpp={r['layout']} rank {rank}"
            assert r["no_nan"], f"{where}: a parameter was not loaded"
            assert r["pad_zero"], f"{where}: vocab padding rows are not zero"
            assert not r["wrong"], f"{where}: differs from the checkpoint: {r['wrong']}"
            assert sorted(r["names"]) == r["expected"], f"{where}: keys differ"
            assert len(set(r["names"])) == len(r["names"]), f"{where}: a key came twice"
            # Each rank reads only what it holds (at most its shard bytes; vocab padding
            # and kv replicas make the shard a little larger than what is read).
            assert r["read"] <= r["local"], f"{where}: read {r['read']} > held {r['local']}"
            tp, pp, _ = r["layout"]
            if tp * pp == 4:
                assert r["read"] < 0.4 * r["total"], f"{where}: read {r['read']} of {r['total']}"


def test_bridge_hf_logits_parity(family_world):
    """Also the HF-parity criterion: the Megatron model built and loaded from an HF
    checkpoint gives HF's logits in fp32."""
    from transformers import AutoModelForCausalLM

    family, paths, ids, results = family_world
    got = [(key, out) for _, logits in results for key, out in logits.items()]
    assert {key for key, _ in got} == {(k, (tp, pp)) for k in paths for tp, pp, _ in LOGIT_LAYOUTS}
    for kind, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(input_ids=ids).logits  # [B, S, V]
        for (k, (tp, pp)), out in got:
            if k == kind:
                assert out.shape == want.shape
                diff = (out - want).abs().max().item()
                assert diff <= 1e-4, f"{family} {kind} tp={tp} pp={pp}: max |logit diff| {diff}"
