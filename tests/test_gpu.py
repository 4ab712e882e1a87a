"""Checks that need an accelerator, run by scripts/gpu_check.sh on a GPU machine.

Skipped without CUDA (CI has none). `MGRPO_GPU_TESTS_ON_CPU=1` runs the same bodies on
the CPU with gloo (the Triton test excepted), to check the tests themselves here.

- the Triton kernels compiled for the GPU, against float64 (values and gradients);
- Megatron-Core on the device with NCCL: the bridge's load gives HF transformers' logits,
  its export stream (device buffers and pinned host buffers, `offload_bridge`) gives back
  the HF checkpoint's tensors bit for bit, and a GRPO step (batches collated on the host,
  the step's entropy threshold, metric partials reduced over DP) runs and gives finite
  metrics and non-zero gradients.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed

ON_CPU = os.environ.get("MGRPO_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA or ON_CPU), reason="needs a CUDA device")]


@pytest.mark.skipif(not HAS_CUDA, reason="Triton kernels compile for the GPU only")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
def test_triton_kernel_on_gpu_matches_float64(dtype, tol):
    from megatron_grpo.kernels import vocab_parallel_logprobs
    from tests.test_kernels_logprob import make_inputs, reference, rel

    torch.backends.cuda.matmul.allow_tf32 = False
    hidden, weight, targets, c_lp, c_ent = make_inputs(515, 256, 32003, seed=5, dtype=dtype)
    r = reference(hidden.float(), weight.float(), targets, 0.7, c_lp, c_ent)
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h, w, targets.cuda(), temperature=0.7,
                                        compute_entropy=True, backend="triton")
    ((c_lp.cuda() * logp).sum() + (c_ent.cuda() * ent).sum()).backward()
    errors = {"logp": rel(logp.detach().cpu(), r[0]), "entropy": rel(ent.detach().cpu(), r[1]),
              "grad_hidden": rel(h.grad.cpu(), r[2]), "grad_weight": rel(w.grad.cpu(), r[3])}
    assert all(e < tol for e in errors.values()), errors


def _megatron_body(rank, world, hf_dir):
    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.algorithms import count_partials, finalize_metrics, loss_normalizer
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.platform import ParallelDims, backend, init_parallel
    from megatron_grpo.train import (LossOptions, micro_batches, reduce_partials,
                                     step_entropy_threshold, train_micro_batches)
    from megatron_grpo.train.batch import collate
    from tests.harness import hf_tensors as _hf_tensors
    from tests.test_train_engine import make_samples
    from transformers import AutoModelForCausalLM

    init_parallel(ParallelDims(world_size=world), seed=0)
    out = {"backend": backend()}
    config, args = build_transformer_config(hf_dir)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, hf_dir)
    dev = next(chunks[0].parameters()).device
    out["device"] = str(dev)

    # Logits against HF transformers on the same device.
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        want = hf(ids.to(dev)).logits.float()
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0).expand_as(ids)
        got = chunks[0](ids.to(dev), pos, None).float()[..., :args.vocab_size]
    out["logits_max_abs_diff"] = (got - want).abs().max().item()

    # Export: device buffers and pinned host buffers give the checkpoint back.
    want_tensors = _hf_tensors(hf_dir)
    for offload in (False, True):
        seen = {}
        for bucket in export_hf_weights(chunks, config, args, bucket_size_bytes=1 << 20,
                                        offload_bridge=offload):
            for name, t in bucket:
                seen[name] = torch.equal(t.detach().cpu(), want_tensors[name])
        out[f"export_offload_{offload}"] = (sorted(seen) == sorted(want_tensors)
                                            and all(seen.values()))

    # One GRPO step with top_entropy_quantile (the step threshold's forward pass too).
    chunks = wrap_ddp(config, chunks)
    samples = make_samples()
    full = collate(samples)
    counts = count_partials(full["completion_mask"], full["completion_mask"])
    norm = loss_normalizer("dapo", counts, generation_counts=counts, max_completion_length=8)
    opts = LossOptions(loss_type="dapo", beta=0.04, top_entropy_quantile=0.5, log_entropy=True)
    batches = micro_batches(samples, 4, pad_to_length=16)
    threshold = step_entropy_threshold(chunks, batches, opts, vocab_size=args.vocab_size)
    parts = train_micro_batches(chunks, batches, opts, normalizer=norm,
                                vocab_size=args.vocab_size, entropy_threshold_value=threshold)
    metrics = {k: float(v) for k, v in finalize_metrics(reduce_partials(parts)).items()}
    grads = {n: p.main_grad.detach().double().cpu() for n, p in
             chunks[0].module.named_parameters()}
    out["metrics"] = metrics
    out["grad_norm"] = sum(g.norm() ** 2 for g in grads.values()).sqrt().item()
    out["threshold"] = float(threshold)
    return out


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("gpu") / "qwen2", family="qwen2",
                               num_layers=2, num_key_value_heads=2, vocab_size=1000))


def test_megatron_on_the_device(tiny_hf):
    (out,) = run_distributed(_megatron_body, 1, args=(tiny_hf,), timeout=600)
    assert out["backend"] == ("nccl" if HAS_CUDA else "gloo")
    assert out["device"].startswith("cuda" if HAS_CUDA else "cpu")
    assert out["logits_max_abs_diff"] <= 1e-4, out
    assert out["export_offload_False"] and out["export_offload_True"], out
    m = out["metrics"]
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
    assert "entropy/entropy_threshold" in m and abs(m["entropy/entropy_threshold"] - out["threshold"]) < 1e-6
    assert out["grad_norm"] > 0 and torch.isfinite(torch.tensor(out["grad_norm"]))
