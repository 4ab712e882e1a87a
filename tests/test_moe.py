"""Mixture-of-experts (issue 16): Qwen3-MoE / Qwen2-MoE on Megatron-Core's MoE layer.

One 4-rank gloo world runs every layout in turn, on a tiny Qwen3-MoE (4 experts, top-2,
norm_topk_prob) and a tiny Qwen2-MoE (shared expert with its sigmoid gate, no top-k
normalisation), both with random weights whose router logits are O(1):
- load (parameters pre-filled with NaN) -> export: bit-exact against the checkpoint, every
  key once, and each rank reads from disk at most what it holds (its experts only);
- logits of the loaded model == HF transformers' (fp32, <= 1e-4);
- gradients (DDP, Megatron's schedule, 4 batches split over the DP ranks) under EP=2 and
  EP=2 x TP=2 == EP=1, in HF layout through the bridge's gradient stream.
Layouts (tp, pp, ep, etp): ranks left over are data-parallel / expert-data-parallel.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

VOCAB = 999
LAYOUTS = {  # (tp, pp, ep, etp)
    "qwen3_moe": [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 2, None), (2, 1, 2, 1),
                  (1, 2, 2, None), (1, 1, 4, None)],
    "qwen2_moe": [(1, 1, 1, None), (2, 1, 2, None)],
}
GRAD_LAYOUTS = [(1, 1, 1, None), (1, 1, 2, None), (2, 1, 2, None)]


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
            held = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
            no_nan = not any(torch.isnan(p).any() for c in chunks for p in c.parameters())
            names, wrong = [], []
            for bucket in export_hf_weights(chunks, config, args, bucket_size_bytes=24 << 10):
                for name, tensor in bucket:
                    names.append(name)
                    if name not in ref or not torch.equal(tensor, ref[name]):
                        wrong.append(name)
            logits = megatron_logits(chunks, config, args, ids).cpu()
            grads = None
            if family == "qwen3_moe" and (tp, pp, ep, etp) in GRAD_LAYOUTS:
                chunks = wrap_ddp(config, chunks)
                # The same 4 batches in every layout: DP rank d of D takes 4/D of them.
                from megatron.core import parallel_state as ps

                dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
                take = slice(d * 4 // dp, (d + 1) * 4 // dp)
                grads = _grads(chunks, config, args, grad_ids[take].flatten(0, 1),
                               grad_weight[take].flatten(0, 1))
            results.append(dict(family=family, layout=(tp, pp, ep, etp), names=names, wrong=wrong,
                                expected=sorted(ref), no_nan=no_nan, read=sum(bytes_read),
                                held=held, logits=logits, grads=grads))
    return results


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
    results = run_distributed(_world, world_size=4, args=(paths, ids, grad_ids, grad_weight),
                              timeout=600)
    return paths, ids, results


def test_moe_bridge_roundtrip_bit_exact(world):
    _, _, results = world
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

    paths, ids, results = world
    for family, path in paths.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(input_ids=ids).logits
        for r in results[0]:
            if r["family"] == family:
                diff = (r["logits"] - want).abs().max().item()
                assert diff <= 1e-4, f"{family} tp,pp,ep,etp={r['layout']}: |logit diff| {diff}"


def test_moe_expert_parallel_gradients_match_ep1(world):
    _, _, results = world
    for rank, runs in enumerate(results):
        by_layout = {r["layout"]: r["grads"] for r in runs if r["grads"] is not None}
        assert set(by_layout) == set(GRAD_LAYOUTS)
        want = by_layout[(1, 1, 1, None)]
        assert any("experts.3.down_proj" in k and want[k].abs().sum() > 0 for k in want)
        for layout, got in by_layout.items():
            assert sorted(got) == sorted(want)
            for k in want:
                scale = want[k].abs().max().item() + 1e-12
                diff = (got[k] - want[k]).abs().max().item()
                assert diff <= 1e-5 * max(scale, 1.0), \
                    f"rank {rank} tp,pp,ep,etp={layout}: grad {k} differs by {diff} ({scale})"


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
])
def test_moe_option_errors(moe_model_dir, extra, needles):
    from tests.test_config_validate import COUNTDOWN, error_of

    message = error_of(["--model", moe_model_dir, "--dataset", COUNTDOWN, "--reward_funcs",
                        "countdown", *extra])
    for needle in needles:
        assert needle in message, (needle, message)


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
