"""The bridge's export stream under TP=2 x PP=2, its memory bound, bad checkpoints, and
the gradients of replicated kv heads. All in one 4-rank gloo world (Megatron's import
in 4 processes dominates the cost on a 2-core machine).

Memory is measured independently of the bridge's own bookkeeping: a TorchDispatchMode
is active only while the generator runs (inside `next()`), records every tensor storage
a torch op creates there (an output whose storage is not one of the op's inputs: views
and in-place collectives do not count), and keeps it "live" until the storage is freed
(a weakref finalizer on the storage). Peak live bytes = the most memory the generator's
tensors held at once, including the bucket handed to the consumer until the consumer
drops it. Not seen: memory outside torch tensors (gloo's own transport buffers, pickles).

"""
from __future__ import annotations

import json
import shutil
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.harness import run_distributed

BUCKET = 64 << 10


class AllocTracker(TorchDispatchMode):
    """Bytes of tensor storages created by torch ops while active, alive until freed."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in inputs and key not in self.live:
                self.live[key] = nbytes
                self.current += nbytes
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


def _hf_tensors(path):
    from tests.harness import hf_tensors as load

    return load(path)


def _stream(rank, world_size, path):
    """TP=2 x PP=2: the stream (plain, offloaded, bf16) and its measured peak memory."""
    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=2, pp=2))
    config, args = build_transformer_config(path, tp=2, pp=2)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, path)
    ref = _hf_tensors(path)
    runs = {}
    for offload in (False, True):
        for dtype in (None, torch.bfloat16):
            tracker = AllocTracker()
            gen = export_hf_weights(chunks, config, args, bucket_size_bytes=BUCKET, dtype=dtype,
                                    offload_bridge=offload)
            names, wrong, bucket_bytes, storages = [], [], [], set()
            while True:
                with tracker:  # only the generator's own work is traced
                    bucket = next(gen, None)
                if bucket is None:
                    break
                bucket_bytes.append([t.numel() * t.element_size() for _, t in bucket])
                for name, tensor in bucket:
                    names.append(name)
                    want = ref[name].to(dtype or ref[name].dtype)
                    if tensor.dtype != want.dtype or not torch.equal(tensor, want):
                        wrong.append(name)
                    storages.add(tensor.untyped_storage().data_ptr())
                del bucket, tensor  # a consumer drops the bucket before the next one
            runs[offload, str(dtype)] = dict(names=names, wrong=wrong, peak=tracker.peak,
                                             bucket_bytes=bucket_bytes, storages=len(storages))
    return runs


def _bad_inputs(rank, world_size, good, bad_tensors, bad_arch):
    """Loading broken checkpoints: every rank raises the same complete error, loads nothing."""
    from bridge import load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=2, pp=2))
    config, args = build_transformer_config(good, tp=2, pp=2)
    chunks = build_model(config, args)
    before = [p.detach().clone() for c in chunks for p in c.parameters()]
    errors = {}
    for kind, path in (("tensors", bad_tensors), ("arch", bad_arch)):
        try:
            load_hf_weights(chunks, config, args, path)
        except ValueError as e:
            errors[kind] = str(e)
    try:
        build_transformer_config(bad_arch, tp=2, pp=2)
    except ValueError as e:
        errors["config"] = str(e)
    untouched = all(torch.equal(a, p) for a, p in zip(before, (p for c in chunks for p in c.parameters())))
    return errors, untouched


def _grads(rank, world_size, paths):
    """Full HF-layout gradients at TP=2 (1 kv head: replicated) before/after the replica sync,
    and at TP=1. qwen2 with plain .grad; qwen3 under Megatron DDP (main_grad)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.model.kv_replication import sync_replicated_kv_grads
    from megatron_grpo.platform import ParallelDims, init_parallel

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (2, 10), generator=gen)
    labels = torch.randint(0, 300, (2, 10), generator=gen)
    positions = torch.arange(10).unsqueeze(0).expand(2, -1)

    def full_grads(chunks, config, args, source):
        return {n: t.clone() for b in export_hf_weights(chunks, config, args, source=source)
                for n, t in b}

    out = {}
    for family, ddp in (("qwen2", False), ("qwen3", True)):
        path = paths[family]
        for tp in (2, 1):
            init_parallel(ParallelDims(world_size=world_size, tp=tp))
            config, args = build_transformer_config(path, tp=tp)
            chunks = build_model(config, args)
            load_hf_weights(chunks, config, args, path)
            if ddp:
                chunks = wrap_ddp(config, chunks)
            logits = chunks[0](ids, positions, None)  # [B, S, V_padded / tp]
            # Cross-entropy over the HF vocab only: Megatron's own (labels=) would also
            # count the zero padding columns, whose number depends on TP.
            full = gather_from_tensor_model_parallel_region(logits)[..., :args.vocab_size]
            torch.nn.functional.cross_entropy(full.flatten(0, 1), labels.flatten(),
                                              reduction="sum").backward()
            if ddp:
                finalize_model_grads(chunks)  # DP average; TP sum of q/k layer-norm grads
            source = (lambda p: p.main_grad) if ddp else (lambda p: p.grad)
            before = full_grads(chunks, config, args, source)
            sync_replicated_kv_grads(chunks, config, args)
            after = full_grads(chunks, config, args, source)
            # The local kv rows of every rank's linear_qkv grad: replicas must now agree.
            kv_rows = []
            for c in chunks:
                for name, p in c.named_parameters():
                    if name.endswith("linear_qkv.weight"):
                        g = source(p)
                        kv_rows.append(g[g.shape[0] - 2 * config.kv_channels:].clone())
            gathered = [None] * ps.get_tensor_model_parallel_world_size()
            torch.distributed.all_gather_object(gathered, kv_rows,
                                                group=ps.get_tensor_model_parallel_group())
            replicas_equal = all(torch.equal(a, b) for other in gathered
                                 for a, b in zip(gathered[0], other))
            out[family, tp] = dict(before=before, after=after, replicas_equal=replicas_equal)
    return out


def _world(rank, world_size, paths):
    return dict(stream=_stream(rank, world_size, paths["stream"]),
                bad=_bad_inputs(rank, world_size, paths["stream"], paths["bad_tensors"],
                                paths["bad_arch"]),
                grads=_grads(rank, world_size, paths))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("bridge_export")
    # Qwen2 (qkv biases), 1 kv head (replicated at TP=2), a wide MLP so that the model
    # (about 1 MB) is far larger than a bucket plus its largest tensor.
    stream = make_tiny_model(root / "stream", family="qwen2", num_layers=4, vocab_size=300,
                             num_key_value_heads=1, intermediate_size=256)
    bad_tensors = root / "bad_tensors"
    shutil.copytree(stream, bad_tensors)
    tensors = load_file(bad_tensors / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]                         # missing
    tensors["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(64, 64)  # unexpected
    tensors["model.layers.1.self_attn.k_proj.bias"] = torch.zeros(17)         # mis-shaped
    save_file(tensors, bad_tensors / "model.safetensors", metadata={"format": "pt"})
    bad_arch = root / "bad_arch"
    shutil.copytree(stream, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    paths = dict(stream=str(stream), bad_tensors=str(bad_tensors), bad_arch=str(bad_arch))
    for family in ("qwen2", "qwen3"):
        paths[family] = str(make_tiny_model(root / family, family=family, vocab_size=300,
                                            num_key_value_heads=1, seed=3))
    return paths, run_distributed(_world, world_size=4, args=(paths,), timeout=300)


def test_bridge_export_stream_tp2_pp2(world):
    paths, results = world
    ref = _hf_tensors(paths["stream"])
    largest = max(t.numel() * t.element_size() for t in ref.values())
    for rank, r in enumerate(results):
        for (offload, dtype), run in r["stream"].items():
            where = f"rank {rank} offload_bridge={offload} dtype={dtype}"
            assert not run["wrong"], f"{where}: differs from the checkpoint: {run['wrong']}"
            assert sorted(run["names"]) == sorted(ref), f"{where}: keys differ"
            assert len(set(run["names"])) == len(run["names"]), f"{where}: a key came twice"
            for sizes in run["bucket_bytes"]:  # full buckets, a big tensor alone
                assert sum(sizes) <= BUCKET or len(sizes) == 1, f"{where}: bucket {sizes}"
            assert len(run["bucket_bytes"]) >= sum(t.numel() * t.element_size()
                                                   for t in ref.values()) // (BUCKET + largest)
            # Every bucket lives in the same reused buffer (CPU: also without offload).
            assert run["storages"] == 1, f"{where}: {run['storages']} bucket buffers"


def test_bridge_export_peak_memory(world):
    paths, results = world
    ref = _hf_tensors(paths["stream"])
    for rank, r in enumerate(results):
        for (offload, dtype), run in r["stream"].items():
            elem = 2 if dtype == "torch.bfloat16" else 4
            largest = max(t.numel() for t in ref.values()) * elem
            total = sum(t.numel() for t in ref.values()) * elem
            bound = BUCKET + largest
            assert total > 3 * bound  # the bound means something for this model
            where = f"rank {rank} offload_bridge={offload} dtype={dtype}"
            assert largest <= run["peak"] <= bound, f"{where}: peak {run['peak']} bound {bound}"


def test_bridge_load_rejects_bad_checkpoints(world):
    _, results = world
    for rank, r in enumerate(results):
        errors, untouched = r["bad"]
        assert untouched, f"rank {rank}: a failed load changed parameters"
        msg = errors["tensors"]
        assert "1 missing, 1 unexpected, 1 mis-shaped" in msg
        assert "missing tensors (1): model.layers.2.mlp.up_proj.weight" in msg
        assert "unexpected tensors (1): model.layers.9.self_attn.q_proj.weight" in msg
        assert "model.layers.1.self_attn.k_proj.bias expected (16,) found (17,)" in msg
        # The bridge names what the checkpoint is and what the model was built as; the
        # model builder names every supported architecture.
        assert "MistralForCausalLM" in errors["arch"] and "Qwen2ForCausalLM" in errors["arch"]
        assert "MistralForCausalLM" in errors["config"]
        for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            assert supported in errors["config"], errors["config"]


def test_bridge_kv_replica_grads_match_tp1(world):
    _, results = world
    for rank, r in enumerate(results):
        grads = r["grads"]
        for family in ("qwen2", "qwen3"):
            tp2, tp1 = grads[family, 2], grads[family, 1]
            assert tp2["replicas_equal"], f"{family} rank {rank}: kv replicas differ after sync"
            assert set(tp2["after"]) == set(tp1["after"])
            for name, want in tp1["after"].items():
                got = tp2["after"][name]
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), \
                    f"{family} {name}: max diff {(got - want).abs().max().item()}"
            # Without the sync, the exported k/v grad is one replica's partial gradient.
            for name in ("model.layers.0.self_attn.k_proj.weight",
                         "model.layers.1.self_attn.v_proj.weight"):
                diff = (tp2["before"][name] - tp1["after"][name]).abs().max().item()
                assert diff > 1e-3 * tp1["after"][name].abs().max().item(), (family, name)
