"""Mixture-of-experts: Qwen3-MoE / Qwen2-MoE on Megatron-Core's MoE layer.

One 4-rank gloo world runs every layout in turn, on a tiny Qwen3-MoE (4 experts, top-2,
norm_topk_prob) and a tiny Qwen2-MoE (shared expert with its sigmoid gate, no top-k
normalisation), both with random weights whose router logits are O(1):
- load (parameters pre-filled with NaN) -> export: bit-exact against the checkpoint, every
  key once, and each rank reads from disk at most what it holds (its experts only);
- logits of the loaded model == HF transformers' (fp32, <= 1e-4);
- gradients (DDP, Megatron's schedule, 4 batches split over the DP ranks) under EP=2,
  EP=2 x TP=2 (experts TP-sharded, and ETP=1: whole experts), and PP=2 x EP=2 (the
  pipeline's p2p sends beside the experts' all-to-all) == EP=1, in HF layout through the
  bridge's gradient stream; also with Megatron's selective recompute of the MoE layer
  (`--recompute_modules moe`, EP=2) and of Qwen2-MoE's shared expert (EP=2 x TP=2);
- the GRPO step's gradients and router losses do not depend on the micro-batches' padding
  (the routers are told it: GPTModel's padding_mask), under TP x PP with sequence
  parallelism, CP and packing alike, and the losses equal HF's router logits' on the real
  tokens;
- a training checkpoint (distributed optimizer) resumes across expert parallel sizes.
Layouts (tp, pp, ep, etp): ranks left over are data-parallel / expert-data-parallel.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed

VOCAB = 999
LAYOUTS = {  # (tp, pp, ep, etp)
    "qwen3_moe": [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 2, None), (2, 1, 2, 1),
                  (1, 2, 2, None), (1, 1, 4, None)],
    "qwen2_moe": [(1, 1, 1, None), (2, 1, 2, None)],
}
# Gradient runs per family: (layout, selective recompute modules or None); each against
# the family's (1, 1, 1, None) run without recompute.
GRAD_RUNS = {
    "qwen3_moe": [((1, 1, 1, None), None), ((1, 1, 2, None), None), ((2, 1, 2, None), None),
                  ((2, 1, 2, 1), None), ((1, 2, 2, None), None), ((1, 1, 2, None), ("moe",))],
    "qwen2_moe": [((1, 1, 1, None), None), ((2, 1, 2, None), ("shared_experts",))],
}


def _hf_tensors(path) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _grads(chunks, config, args, ids, weight):
    """Gradients of sum(logits * weight) / numel in HF layout (DDP-reduced, full tensors)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from bridge import export_hf_weights

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    rows = args.padded_vocab_size // tp
    w = torch.zeros(*ids.shape, args.padded_vocab_size)
    w[..., :VOCAB] = weight
    numel = w.numel()  # of the whole logits, not of this rank's vocab shard
    w = w[..., tp_rank * rows:(tp_rank + 1) * rows]
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)

    def step(data_iterator, model):
        out = model(ids, positions, None)  # [B, S, V/tp]

        def loss(o):
            # Each TP rank's share of the loss; the TP ranks' gradients add up in backward.
            return (o.float() * w).sum() / numel, {}

        return out, loss

    for c in chunks:
        c.train()
        c.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=chunks,
                                num_microbatches=1, seq_length=ids.shape[1],
                                micro_batch_size=ids.shape[0], forward_only=False)
    out = {}
    for bucket in export_hf_weights(chunks, config, args, source=lambda p: p.main_grad,
                                    dtype=torch.float32):
        out.update({k: t.clone() for k, t in bucket})
    return out


def _world(rank, world_size, paths, ids, grad_ids, grad_weight):
    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.convert import megatron_logits
    from bridge.hf_checkpoint import HFCheckpoint
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.model.builder import wrap_ddp
    from megatron_grpo.platform import ParallelDims, init_parallel

    bytes_read = []
    original_read = HFCheckpoint.read

    def counting_read(self, *a, **kw):
        t = original_read(self, *a, **kw)
        bytes_read.append(t.numel() * t.element_size())
        return t

    HFCheckpoint.read = counting_read
    results = []
    for family, path in paths.items():
        ref = _hf_tensors(path)
        for tp, pp, ep, etp in LAYOUTS[family]:
            init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp, ep=ep, etp=etp))
            # Megatron trains MoE under TP only with sequence parallelism.
            config, args = build_transformer_config(path, tp=tp, pp=pp, ep=ep, etp=etp,
                                                    sequence_parallel=tp > 1)
            chunks = build_model(config, args)
            for c in chunks:
                for p in c.parameters():
                    p.data.fill_(float("nan"))
            bytes_read.clear()
            load_hf_weights(chunks, config, args, path)
            read = sum(bytes_read)
            held = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
            no_nan = not any(torch.isnan(p).any() for c in chunks for p in c.parameters())
            names, wrong = [], []
            for bucket in export_hf_weights(chunks, config, args, bucket_size_bytes=24 << 10):
                for name, tensor in bucket:
                    names.append(name)
                    if name not in ref or not torch.equal(tensor, ref[name]):
                        wrong.append(name)
            logits = megatron_logits(chunks, config, args, ids).cpu()
            grads = {}
            for layout, recompute in GRAD_RUNS.get(family, []):
                if layout != (tp, pp, ep, etp):
                    continue
                if recompute:   # a model of its own, Megatron's selective recompute on
                    config, args = build_transformer_config(
                        path, tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1,
                        recompute=dict(recompute_granularity="selective",
                                       recompute_modules=list(recompute)))
                    chunks = build_model(config, args)
                    load_hf_weights(chunks, config, args, path)
                ddp = wrap_ddp(config, chunks)
                # The same 4 batches in every layout: DP rank d of D takes 4/D of them.
                from megatron.core import parallel_state as ps

                dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
                take = slice(d * 4 // dp, (d + 1) * 4 // dp)
                grads[recompute] = _grads(ddp, config, args, grad_ids[take].flatten(0, 1),
                                          grad_weight[take].flatten(0, 1))
            results.append(dict(family=family, layout=(tp, pp, ep, etp), names=names, wrong=wrong,
                                expected=sorted(ref), no_nan=no_nan, read=read,
                                held=held, logits=logits, grads=grads))
    return results, _padding_runs(world_size, paths["qwen3_moe"])


# ---------------------------------------------------------------- padding and the router
# The GRPO step (train_micro_batches) on a Qwen3-MoE with the load-balancing loss (and the
# z-loss) on: its micro-batches padded to their longest row, or 8 columns more, at TP=1, at
# TP=2 x PP=2 with sequence parallelism (the mask split over TP on both stages), at CP=2
# (the mask in CP chunks) and packed (--padding_free: the filler between sequences). The
# padding is not the model's input: neither the gradients nor the logged losses may depend
# on it. Runs: ((tp, pp, cp, packed), router losses, padding, routers told the padding).
# The z-loss runs at TP=1 only: under sequence parallelism Megatron averages each TP rank's
# own mean over its valid tokens, which is exact only where the ranks hold equal counts.
TP1 = (1, 1, 1, False)
PAD_RUNS = [(TP1, "aux+z", "natural", True), (TP1, "aux+z", "long", True),
            (TP1, "aux+z", "long", False),   # negative control
            (TP1, "aux", "natural", True),
            ((2, 2, 1, False), "aux", "natural", True), ((2, 2, 1, False), "aux", "long", True),
            ((1, 1, 2, False), "aux", "long", True), ((1, 1, 1, True), "aux", "long", True)]
PAD_SAMPLES, PAD_MBS = 8, 2


def _padding_samples():
    from megatron_grpo.train import Sample

    g = torch.Generator().manual_seed(7)

    def ids(low, high):
        return torch.randint(0, VOCAB, (int(torch.randint(low, high, (1,), generator=g)),),
                             generator=g).tolist()
    return [Sample(prompt_ids=ids(2, 5), completion_ids=ids(1, 8),
                   advantage=float(torch.randn((), generator=g)), truncated=False)
            for _ in range(PAD_SAMPLES)]


def _padding_runs(world_size, path):
    from megatron.core import parallel_state as ps

    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.algorithms import count_partials, loss_normalizer
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.model.builder import wrap_ddp
    from megatron_grpo.model.moe import MoEOptions, step_metrics
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train import LossOptions, engine, micro_batches, train_micro_batches
    from megatron_grpo.train.batch import collate

    samples = _padding_samples()
    full = collate(samples)
    counts = count_partials(full["completion_mask"], full["completion_mask"])
    norm = loss_normalizer("grpo", counts, generation_counts=counts, max_completion_length=8)
    natural = -(-full["input_ids"].shape[1] // 4) * 4    # a multiple of TP (sequence parallel)
    out, built = {}, None
    for layout, losses, padding, masked in PAD_RUNS:
        if built != (layout, losses):
            built = layout, losses
            tp, pp, cp, packed = layout
            init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp, cp=cp))
            config, args = build_transformer_config(
                path, tp=tp, pp=pp, cp=cp, sequence_parallel=tp > 1,
                moe=MoEOptions(aux_loss_coeff=0.01,
                               z_loss_coeff=0.001 if losses == "aux+z" else None))
            chunks = build_model(config, args, padding_free=packed)
            load_hf_weights(chunks, config, args, path)
            chunks = wrap_ddp(config, chunks)
            dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            mine = samples[d * PAD_SAMPLES // dp:(d + 1) * PAD_SAMPLES // dp]
        for c in chunks:
            c.zero_grad_buffer()
        kept = engine.with_token_valid
        if not masked:
            engine.with_token_valid = lambda batch: batch
        try:
            length = natural + (8 if padding == "long" else 0)
            train_micro_batches(chunks, micro_batches(mine, PAD_MBS, pad_to_length=length),
                                LossOptions(loss_type="grpo"), normalizer=norm, vocab_size=VOCAB)
        finally:
            engine.with_token_valid = kept
        metrics = step_metrics(config, len(mine) // PAD_MBS)
        grads = {}
        for bucket in export_hf_weights(chunks, config, args, source=lambda p: p.main_grad,
                                        dtype=torch.float32):
            grads.update({k: t.clone() for k, t in bucket})
        out[layout, losses, padding, masked] = grads, metrics
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    paths = {f: str(make_tiny_model(tmp_path_factory.mktemp(f), family=f, vocab_size=VOCAB,
                                    max_shard_size="40KB" if f == "qwen3_moe" else None))
             for f in LAYOUTS}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
    grad_ids = torch.randint(0, VOCAB, (4, 2, 10), generator=gen)
    grad_weight = torch.randn(4, 2, 10, VOCAB, generator=gen)
    out = run_distributed(_world, world_size=4, args=(paths, ids, grad_ids, grad_weight),
                          timeout=600)
    return paths, ids, [r for r, _ in out], [padding for _, padding in out]


def test_moe_bridge_roundtrip_bit_exact(world):
    _, _, results, _ = world
    for rank, runs in enumerate(results):
        assert len(runs) == sum(len(v) for v in LAYOUTS.values())
        for r in runs:
            where = f"{r['family']} tp,pp,ep,etp={r['layout']} rank {rank}"
            assert r["no_nan"], f"{where}: a parameter was not loaded"
            assert not r["wrong"], f"{where}: differs from the checkpoint: {r['wrong']}"
            assert sorted(r["names"]) == r["expected"], f"{where}: keys differ"
            assert len(set(r["names"])) == len(r["names"]), f"{where}: a key came twice"
            # Each rank reads its own experts (and TP slices) only.
            assert r["read"] <= r["held"], f"{where}: read {r['read']} > held {r['held']}"


def test_moe_logits_match_hf(world):
    from transformers import AutoModelForCausalLM

    paths, ids, results, _ = world
    for family, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(input_ids=ids).logits
        for r in results[0]:
            if r["family"] == family:
                diff = (r["logits"] - want).abs().max().item()
                assert diff <= 1e-4, f"{family} tp,pp,ep,etp={r['layout']}: |logit diff| {diff}"


def test_moe_expert_parallel_gradients_match_ep1(world):
    _, _, results, _ = world
    for rank, runs in enumerate(results):
        for family, expected in GRAD_RUNS.items():
            got_runs = {(r["layout"], recompute): g for r in runs if r["family"] == family
                        for recompute, g in r["grads"].items()}
            assert set(got_runs) == set(expected)
            want = got_runs[((1, 1, 1, None), None)]
            assert any("experts.3.down_proj" in k and want[k].abs().sum() > 0 for k in want)
            for (layout, recompute), got in got_runs.items():
                where = f"rank {rank} {family} tp,pp,ep,etp={layout} recompute {recompute}"
                assert sorted(got) == sorted(want), where
                for k in want:
                    scale = want[k].abs().max().item() + 1e-12
                    diff = (got[k] - want[k]).abs().max().item()
                    assert diff <= 1e-5 * max(scale, 1.0), \
                        f"{where}: grad {k} differs by {diff} ({scale})"


def _router_losses_reference(path):
    """float64 load_balancing_loss and z_loss of the PAD_SAMPLES step from HF transformers'
    router logits on the real tokens only (each row run alone, unpadded), as Megatron
    defines them per layer and micro-batch of T tokens, top-k of E experts:
    E / (k T^2) sum_e (sum_t p_te)(sum_t routed_te) and mean_t logsumexp_t^2; then the
    mean over layers and micro-batches (step_metrics)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    k, n_experts = hf.config.num_experts_per_tok, hf.config.num_experts
    samples = _padding_samples()
    lb, z = [], []
    for i in range(0, PAD_SAMPLES, PAD_MBS):
        per_layer = None
        for s in samples[i:i + PAD_MBS]:
            ids = torch.tensor([s.prompt_ids + s.completion_ids[:-1]])
            with torch.no_grad():
                logits = hf(input_ids=ids, output_router_logits=True).router_logits
            rows = [x.reshape(-1, n_experts).double() for x in logits]
            per_layer = rows if per_layer is None else \
                [torch.cat([a, b]) for a, b in zip(per_layer, rows)]
        for x in per_layer:
            p = torch.softmax(x, dim=-1)
            routed = torch.zeros_like(p).scatter(1, p.topk(k, dim=-1).indices, 1.0)
            t = x.shape[0]
            lb.append(n_experts / (k * t * t) * (p.sum(0) * routed.sum(0)).sum())
            z.append((torch.logsumexp(x, dim=-1) ** 2).mean())
    return torch.stack(lb).mean().item(), torch.stack(z).mean().item()


def test_moe_padding_leaves_the_router_losses_and_gradients_unchanged(world):
    """MoE micro-batches pass their padding to the routers (GPTModel's padding_mask): the
    step's gradients and its load_balancing_loss / z_loss do not change with the padding,
    match across TP x PP with sequence parallelism, and the losses equal HF's router
    logits' on the real tokens. Without the mask the padding changes all three."""
    paths, _, _, padding = world
    lb, z = _router_losses_reference(paths["qwen3_moe"])
    for rank, runs in enumerate(padding):
        grads, metrics = runs[TP1, "aux+z", "natural", True]
        assert metrics["load_balancing_loss"] == pytest.approx(lb, rel=1e-5), (rank, metrics)
        assert metrics["z_loss"] == pytest.approx(z, rel=1e-5), (rank, metrics)
        assert any("mlp.gate.weight" in k and grads[k].abs().sum() > 0 for k in grads)
        want_aux = (TP1, "aux", "natural", True)
        same = [((TP1, "aux+z", "long", True), (TP1, "aux+z", "natural", True))] + \
            [(run, want_aux) for run in PAD_RUNS if run[1] == "aux" and run != want_aux]
        for got_key, want_key in same:
            (got, got_m), (want, want_m) = runs[got_key], runs[want_key]
            where = f"rank {rank}: {got_key} vs {want_key}"
            assert sorted(got) == sorted(want), where
            for name in want_m:
                assert got_m[name] == pytest.approx(want_m[name], rel=1e-5), (where, name)
            for name in want:
                scale = max(want[name].abs().max().item(), 1e-6)
                diff = (got[name] - want[name]).abs().max().item()
                assert diff <= 1e-5 * max(scale, 1.0), f"{where}: grad {name} differs by {diff}"
        unmasked, unmasked_m = runs[TP1, "aux+z", "long", False]
        assert unmasked_m["load_balancing_loss"] != pytest.approx(lb, rel=1e-3)
        assert max((unmasked[name] - grads[name]).abs().max().item()
                   for name in grads if "mlp.gate.weight" in name) > 1e-5


# ---------------------------------------------------------------- resume at EP=2
# A training checkpoint of a 2-rank EP=2 run (distributed optimizer: the experts' Adam
# moments live on their EP rank, the rest are sharded over DP) resumes in new processes:
# at EP=2 bit for bit, and at EP=1 (each rank now holds all 4 experts, their moments
# re-sharded over DP; Megatron chains one optimizer there instead of a dense and an expert
# one) within fp32 noise, and an EP=1 save of that resumes at EP=2 the same. A restarted
# Adam (weights only) is far off, so the comparison sees the moments.
SEQ, MBS = 10, 2


def _moe_trainer(world_size, path, ep, load_hf=False, dist_opt=True):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.model.builder import wrap_ddp
    from megatron_grpo.model.moe import MoEOptions
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, ep=ep))
    config, args = build_transformer_config(path, ep=ep, moe=MoEOptions(aux_loss_coeff=0.01))
    chunks = build_model(config, args)
    if load_hf:
        from bridge import load_hf_weights

        load_hf_weights(chunks, config, args, path)
    else:                # whatever the checkpoint does not restore stays NaN
        for c in chunks:
            for p in c.parameters():
                p.data.fill_(float("nan"))
    chunks = wrap_ddp(config, chunks, use_distributed_optimizer=dist_opt)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, bf16=False,
                        use_distributed_optimizer=dist_opt, clip_grad=1.0), chunks)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-3, min_lr=3e-4,
                                    lr_warmup_steps=1, lr_decay_steps=6, lr_decay_style="cosine",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=6,
                                    wd_incr_style="constant")
    return chunks, config, args, opt, sched


def _moe_step(chunks, opt, sched, step):
    """One optimizer step on the 4 micro-batches of `step` (split over DP); their mean loss."""
    from megatron.core import parallel_state as ps

    from tests.mcore_utils import fixed_batches, run_schedule

    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses, _ = run_schedule(chunks, fixed_batches(4, MBS, SEQ, VOCAB, seed=100 + step)[dp_rank::dp],
                             SEQ, MBS)
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)
    loss = torch.tensor(sum(losses) / len(losses))
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return (loss / dp).item()


def _hf_weights(chunks, config, args):
    from bridge import export_hf_weights

    return {k: t.clone() for b in export_hf_weights(chunks, config, args) for k, t in b}


def _train_save_continue(rank, world, path, out):
    from megatron_grpo.checkpoint import save_checkpoint

    chunks, config, args, opt, sched = _moe_trainer(world, path, ep=2, load_hf=True)
    for step in (1, 2):
        _moe_step(chunks, opt, sched, step)
    save_checkpoint(out, 2, chunks, opt, sched, extra_state={"step": 2},
                    optim_sharding_type="fully_reshardable")     # loaded at another EP
    losses = [_moe_step(chunks, opt, sched, step) for step in (3, 4)]
    return losses, _hf_weights(chunks, config, args)


def _resume(rank, world, path, out):
    from megatron_grpo.checkpoint import load_checkpoint, resume, save_checkpoint

    got = {}
    for ep, src in ((2, out), (1, out), ("1->2", out + "_ep1")):
        chunks, config, args, opt, sched = _moe_trainer(world, path, ep=2 if ep == "1->2" else ep)
        extra = resume(src, chunks, opt, sched)
        if ep == 1:  # and back: the state loaded at EP=1, saved by EP=1, resumed at EP=2
            save_checkpoint(out + "_ep1", 2, chunks, opt, sched, extra_state=extra,
                            optim_sharding_type="fully_reshardable")
        losses = [_moe_step(chunks, opt, sched, extra["step"] + i) for i in (1, 2)]
        got[ep] = losses, _hf_weights(chunks, config, args)
    # Negative control: the weights without the optimizer state (Adam restarted).
    chunks, config, args, opt, sched = _moe_trainer(world, path, ep=2)
    load_checkpoint(os.path.join(out, "checkpoint-2"), chunks)
    for step in (3, 4):
        _moe_step(chunks, opt, sched, step)
    got["restarted"] = None, _hf_weights(chunks, config, args)
    # Megatron's plain optimizer: its state is not regrouped across EP > 1 <-> EP = 1.
    chunks, config, args, opt, sched = _moe_trainer(world, path, ep=1, dist_opt=False)
    try:
        resume(out, chunks, opt, sched)
        got["plain"] = "loaded"
    except ValueError as e:
        got["plain"] = str(e)
    return got


def test_moe_training_checkpoint_resumes_across_expert_parallel_sizes(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path_factory.mktemp("resume"), family="qwen3_moe",
                               vocab_size=VOCAB))
    out = str(tmp_path_factory.mktemp("resume_run"))
    continued = run_distributed(_train_save_continue, 2, args=(path, out), timeout=400)
    resumed = run_distributed(_resume, 2, args=(path, out), timeout=400)
    want_losses, want = continued[0]
    assert any("experts.3" in k for k in want)
    for rank in range(2):
        for ep in (2, 1, "1->2"):
            losses, got = resumed[rank][ep]
            assert sorted(got) == sorted(want)
            if ep == 2:  # the saving layout: bit for bit (step 4 also checks the moments)
                assert losses == want_losses, (rank, losses, want_losses)
                for k in want:
                    assert torch.equal(got[k], want[k]), f"rank {rank} EP=2: {k} differs"
            else:        # experts re-sharded (EP=1, or EP=2 from EP=1): up to reduction order
                torch.testing.assert_close(losses, want_losses, atol=1e-5, rtol=1e-5)
                for k in want:
                    torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5,
                                               msg=lambda m, k=k, ep=ep: f"rank {rank} EP {ep} {k}: {m}")
        assert "only with --use_distributed_optimizer true" in resumed[rank]["plain"]
        _, restarted = resumed[rank]["restarted"]
        worst = max((restarted[k] - want[k]).abs().max().item() for k in want)
        assert worst > 1e-4, "the test cannot tell a restarted optimizer from a resumed one"


# ---------------------------------------------------------------- options (no processes)
@pytest.fixture
def moe_model_dir(tmp_path):
    import json

    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    return str(d)


@pytest.mark.parametrize("extra, needles", [
    (["--expert_model_parallel_size", "3"], ["--expert_model_parallel_size 3", "4 experts",
                                             "[1, 2, 4]"]),
    (["--tensor_model_parallel_size", "2"], ["--tensor_model_parallel_size 2", "MoE",
                                             "--sequence_parallel true"]),
    (["--moe_grouped_gemm", "true"], ["--moe_grouped_gemm true", "Transformer Engine"]),
    (["--moe_permute_fusion", "true"], ["--moe_permute_fusion true", "Transformer Engine"]),
    (["--moe_token_dispatcher_type", "flex"], ["--moe_token_dispatcher_type 'flex'",
                                               "not supported yet", "alltoall"]),
    (["--moe_token_dispatcher_type", "allgather"], ["allgather", "variable sequence lengths"]),
    (["--moe_aux_loss_coeff", "-1"], ["--moe_aux_loss_coeff -1"]),
    (["--moe_pad_expert_input_to_capacity", "true"], ["--moe_expert_capacity_factor"]),
    (["--moe_router_topk", "2"], ["--moe_router_topk is an ms-swift option not supported yet",
                                  "config.json"]),
    (["--recompute_modules", "core_attn", "mlp"], ["--recompute_modules core_attn, mlp",
                                                   "every layer of this MoE model",
                                                   "Fix: moe"]),
    (["--recompute_modules", "moe_act"], ["moe_act", "--moe_grouped_gemm", "Fix: moe"]),
    (["--recompute_modules", "shared_experts"], ["shared_experts needs a model with a shared "
                                                 "expert", "qwen3_moe has none"]),
    (["--recompute_modules", "moe", "layernorm"], None),   # allowed
    (["--recompute_modules", "mlp", "--recompute_granularity", "none"], None),
    (["--moe_layer_recompute", "true"], None),
    (["--moe_layer_recompute", "true", "--recompute_granularity", "none"],
     ["--moe_layer_recompute true is a selective recompute", "--recompute_granularity none"]),
])
def test_moe_option_errors(moe_model_dir, extra, needles):
    from megatron_grpo.config import parse_rlhf_args
    from tests.test_config_validate import COUNTDOWN, error_of

    argv = ["--model", moe_model_dir, "--dataset", COUNTDOWN, "--reward_funcs", "countdown",
            *extra]
    if needles is None:
        parse_rlhf_args(argv)
        return
    message = error_of(argv)
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("module", ["moe", "shared_experts", "moe_act"])
def test_moe_recompute_modules_refused_on_a_dense_model(tmp_path, module):
    import json

    from tests.test_config_validate import COUNTDOWN, error_of

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    message = error_of(["--model", str(tmp_path), "--dataset", COUNTDOWN, "--reward_funcs",
                        "countdown", "--recompute_modules", module])
    assert f"--recompute_modules {module} recomputes part of a mixture-of-experts layer" in \
        message and "is dense" in message, message
    message = error_of(["--model", str(tmp_path), "--dataset", COUNTDOWN, "--reward_funcs",
                        "countdown", "--moe_layer_recompute", "true"])
    assert "--moe_layer_recompute true recomputes mixture-of-experts layers" in message


def test_moe_layer_recompute_adds_the_moe_module(moe_model_dir):
    from megatron_grpo.config import parse_rlhf_args
    from megatron_grpo.train.setup import recompute_modules_of
    from tests.test_config_validate import COUNTDOWN

    cfg = parse_rlhf_args(["--model", moe_model_dir, "--dataset", COUNTDOWN, "--reward_funcs",
                           "countdown", "--moe_layer_recompute", "true"])
    assert recompute_modules_of(cfg.training) == ["core_attn", "moe"]


def test_moe_options_reach_the_transformer_config(tmp_path):
    from megatron_grpo.config import parse_rlhf_args, validate_world
    from megatron_grpo.model import build_transformer_config
    from megatron_grpo.model.moe import MoEOptions
    from tests.test_config_validate import COUNTDOWN
    from tools.make_tiny_model import make_tiny_model

    path = str(make_tiny_model(tmp_path / "m", family="qwen3_moe", head_dim=32))
    cfg = parse_rlhf_args(["--model", path, "--dataset", COUNTDOWN, "--reward_funcs", "countdown",
                           "--moe_aux_loss_coeff", "0.01", "--moe_z_loss_coeff", "0.001",
                           "--moe_expert_capacity_factor", "1.5",
                           "--expert_model_parallel_size", "2"])
    with pytest.raises(ValueError, match="expert_model_parallel_size 2 x"):
        validate_world(cfg, 3)
    from megatron_grpo.config.dry_run import _experts_line

    assert _experts_line(cfg.parallel, validate_world(cfg, 2)) == \
        "; experts EP 2 x ETP 1 x expert DP 1"
    config, _ = build_transformer_config(path, moe=MoEOptions.from_config(cfg))
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    assert config.moe_router_pre_softmax is False          # norm_topk_prob true
    assert config.moe_router_load_balancing_type == "aux_loss"
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (0.01, 0.001)
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_grouped_gemm is False
    with pytest.raises(ValueError, match="--expert_model_parallel_size 2 / "):
        build_transformer_config(str(make_tiny_model(tmp_path / "d", family="qwen3")), ep=2)
