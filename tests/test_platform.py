"""Platform layer, start-up validation and the `megatron` entry point."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_grpo.model import build_transformer_config
from megatron_grpo.platform import ParallelDims
from tests.mcore_utils import TINY_QWEN2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parallel_dims_derives_dp():
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert dims.dp == 2 and dims.tp_enabled and dims.pp_enabled and not dims.cp_enabled


def test_tp_not_dividing_world_size():
    with pytest.raises(ValueError) as e:
        ParallelDims(world_size=2, tp=3)
    msg = str(e.value)
    assert "--tensor_model_parallel_size 3" in msg and "world size 2" in msg
    assert "[1, 2]" in msg  # the valid values


def test_vpp_needs_pp():
    with pytest.raises(ValueError, match="--virtual_pipeline_model_parallel_size 2 needs"):
        ParallelDims(world_size=2, tp=1, pp=1, vpp=2)


def test_tp_not_dividing_heads():
    with pytest.raises(ValueError) as e:
        build_transformer_config(TINY_QWEN2, tp=3)
    msg = str(e.value)
    assert "--tensor_model_parallel_size 3" in msg and "4 attention heads" in msg
    assert "[1, 2, 4]" in msg


def test_unsupported_architecture():
    hf = dict(TINY_QWEN2, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError) as e:
        build_transformer_config(hf)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_layers_not_splitting_into_stages():
    with pytest.raises(ValueError, match="cannot be split evenly"):
        build_transformer_config(dict(TINY_QWEN2, num_hidden_layers=3), pp=2)


@pytest.mark.parametrize("family,expect", [
    ("qwen2", dict(add_qkv_bias=True, qk_layernorm=False)),
    ("qwen3", dict(add_qkv_bias=False, qk_layernorm=True)),
    ("llama", dict(add_qkv_bias=False, qk_layernorm=False))])
def test_family_config_mapping(family, expect):
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "llama": "LlamaForCausalLM"}[family]
    hf = dict(TINY_QWEN2, architectures=[arch], model_type=family, head_dim=32,
              rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True)
    config, args = build_transformer_config(hf, tp=2)
    for k, v in expect.items():
        assert getattr(config, k) == v, k
    assert config.kv_channels == 32 and config.layernorm_epsilon == 1e-5
    assert config.num_query_groups == 2 and config.hidden_dropout == 0.0
    assert args.rotary_base == 5e5 and args.tie_word_embeddings
    assert args.padded_vocab_size == 1024 and args.padded_vocab_size % 2 == 0


def test_fewer_kv_heads_than_tp_replicates_groups():
    config, _ = build_transformer_config(dict(TINY_QWEN2, num_key_value_heads=1), tp=2)
    assert config.num_query_groups == 2


def _cpu_layer_probe(rank, world):
    from megatron_grpo.platform import cpu

    assert cpu.install()
    t = torch.zeros(2, device="cuda")            # device= naming CUDA lands on the CPU
    assert t.device.type == "cpu"
    assert t.cuda() is t
    assert t.type() == "torch.cuda.FloatTensor"  # the spelling Megatron compares against
    assert torch.cuda.current_device() == "cpu"
    # The "CUDA" RNG is a separate CPU generator state that Megatron's tracker swaps.
    from megatron.core.tensor_parallel import random as mrandom

    state = mrandom._get_cuda_rng_state(clone=True)
    a = torch.rand(3)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    return True


def test_cpu_layer():
    from tests.harness import run_distributed

    assert run_distributed(_cpu_layer_probe, 1, fresh=True) == [True]  # needs a new process


def _gloo_threads() -> int:
    """This process's gloo TCP loop threads: one per live gloo process group."""
    tasks = "/proc/self/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "gloo_tcp_loop"
               for t in os.listdir(tasks))


def _relayout(rank, world):
    from megatron_grpo.model import wrap_ddp
    from tests.mcore_utils import setup

    counts = []
    for tp in (2, 1, 2, 1, 2):
        config, _, chunks = setup(world, tp=tp)
        wrap_ddp(config, chunks)       # models hold their groups (DDP) in reference cycles
        counts.append(_gloo_threads())
        del config, chunks             # garbage, as a finished test's models are
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_parallel_state_set_up_again_frees_the_old_groups():
    """init_parallel over an initialised state destroys the groups of the old layout: each
    gloo group keeps threads until destroyed, and a world running layout after layout
    piled up thousands (compat.megatron.destroy_model_parallel)."""
    from tests.harness import run_distributed

    for counts in run_distributed(_relayout, 2):
        assert counts[0] > 5                              # Megatron's groups: gloo each
        assert counts[2] <= counts[0] + 1 and counts[4] <= counts[0] + 1, counts
        assert counts[3] <= counts[1] + 1, counts


def _megatron(*args, env=None, timeout=60, python_flags=()):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, *python_flags, "-m", "megatron_grpo.cli", *args], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=timeout)


def test_cli_help_lists_subcommands():
    r = _megatron("--help")
    assert r.returncode == 0
    for sub in ("rlhf", "rollout", "export"):
        assert sub in r.stdout


def test_cli_unknown_command():
    r = _megatron("train")
    assert r.returncode == 2 and "valid commands: rlhf, rollout, export" in r.stderr


def test_cli_tp3_on_two_ranks_fails_fast(tmp_path, tiny_model):
    model = tiny_model(family="qwen2")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "solution": "2"}\n' * 8)
    r = _megatron("rlhf", "--rlhf_type", "grpo", "--model", str(model), "--dataset", str(data),
                  "--reward_funcs", "accuracy", "--tensor_model_parallel_size", "3",
                  env={"NPROC_PER_NODE": "2"}, python_flags=("-X", "importtime"))
    assert r.returncode == 2, r.stderr
    assert "tensor_model_parallel_size" in r.stderr and "3" in r.stderr
    assert "Traceback" not in r.stderr
    # It fails before heavy start-up: nothing of torch/Megatron/vLLM was imported.
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in r.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert not imported & {"torch", "megatron", "vllm"}, imported & {"torch", "megatron", "vllm"}


def test_more_workers_than_gpus_is_refused(monkeypatch):
    """A worker whose LOCAL_RANK has no GPU of its own is refused before the process group
    (it used to share GPU LOCAL_RANK % count with another: NCCL's "duplicate GPU" or out
    of memory, late). The GPU count is faked: this machine may have none."""
    import torch.distributed as dist

    from megatron_grpo import platform

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(platform, "has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started"))
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_PORT": "29999", "CUDA_VISIBLE_DEVICES": "0,1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"LOCAL_RANK 3 has no GPU of its own: this node sees 2 "
                                         r"\(CUDA_VISIBLE_DEVICES=0,1\) for 4 workers\. Fix: "
                                         "NPROC_PER_NODE=2"):
        platform.init_process_group()
