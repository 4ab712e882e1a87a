"""The vLLM KV cache is sized in bytes from the run, never as a fraction of a NUMA node.

Unit tests check the byte figures against hand-computed ones from a config.json. The
engine test proves it machine-independently: vLLM's node-memory probe is patched to
report a small node (4 GiB total, 512 MiB available) while the process already holds
a Megatron model; the real vLLM engine must start and generate. As a control, the
same patched probe makes vLLM's fraction path refuse to start, so the patch is live.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from megatron_grpo.config import parse_rlhf_args
from megatron_grpo.config.rollout_server import parse_rollout_args
from megatron_grpo.config.sizes import parse_size
from megatron_grpo.rollout.kv_cache import (FLOOR_BYTES, kv_bytes_per_token, kv_cache_bytes,
                                            kv_cache_engine_kwargs, sequences_per_engine)
from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 2**20, 2**30
# Qwen2.5-0.5B's attention shape: 24 layers, 14 heads of 64 (hidden 896), 2 kv heads.
QWEN05 = {"model_type": "qwen2", "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "hidden_size": 896, "max_position_embeddings": 32768,
          "torch_dtype": "bfloat16"}


@pytest.fixture
def qwen05(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN05))
    return str(tmp_path)


# ------------------------------------------------------------------ byte figures
def test_kv_bytes_per_token_by_hand(qwen05):
    # 2 (K, V) x 24 layers x 2 kv heads x 64 head_dim x 2 bytes (bf16) = 12288
    assert kv_bytes_per_token(qwen05) == 12288
    assert kv_bytes_per_token(qwen05, dtype="float32") == 24576
    assert kv_bytes_per_token(qwen05, kv_cache_dtype="fp8_e4m3") == 6144
    # TP=2: one kv head per worker; TP=4: vLLM replicates, still one per worker.
    assert kv_bytes_per_token(qwen05, tensor_parallel_size=2) == 6144
    assert kv_bytes_per_token(qwen05, tensor_parallel_size=4) == 6144


def test_kv_cache_bytes_by_hand(qwen05, tmp_path):
    # 16 sequences x 1024 tokens x 12288 B = 192 MiB, x 1.25 = 240 MiB.
    assert kv_cache_bytes(qwen05, sequences=16, max_model_len=1024) == 240 * MiB
    # A length of 1000 takes whole 128-token blocks: 1024 again.
    assert kv_cache_bytes(qwen05, sequences=16, max_model_len=1000) == 240 * MiB
    # No max_model_len: the model's 32768; 2 x 32768 x 12288 x 1.25 = 960 MiB.
    assert kv_cache_bytes(qwen05, sequences=2) == 960 * MiB
    # A tiny model's need (8 x 256 x 1024 B = 2 MiB) is lifted to the 64 MiB floor.
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "hidden_size": 128, "max_position_embeddings": 512}))
    assert kv_bytes_per_token(str(tiny), dtype="float32") == 2 * 2 * 2 * 32 * 4
    assert kv_cache_bytes(str(tiny), sequences=8, max_model_len=256, dtype="float32") == FLOOR_BYTES
    # A vision-language config: the language model's shape (text_config).
    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "text_config": QWEN05}))
    assert kv_bytes_per_token(str(vl)) == 12288


def test_sequences_per_engine():
    # 32 completions / 8 per prompt = 4 prompts over 2 ranks: 2 prompts x 8 per rank.
    assert sequences_per_engine(32, 8, world_size=2, vllm_tensor_parallel_size=1) == 16
    # A TP=2 engine pools both ranks' shares.
    assert sequences_per_engine(32, 8, world_size=2, vllm_tensor_parallel_size=2) == 32
    # 4 prompts over 3 ranks: at most ceil(4/3) = 2 prompts on a rank.
    assert sequences_per_engine(32, 8, world_size=3, vllm_tensor_parallel_size=1) == 16
    assert sequences_per_engine(32, 8, 2, 2, max_num_seqs=10) == 10


def test_engine_kwargs_precedence(qwen05):
    need = dict(sequences=16, max_model_len=1024)
    # CPU: computed; GPU: nothing (gpu_memory_utilization applies).
    assert kv_cache_engine_kwargs(qwen05, on_cpu=True, environ={}, **need) == {
        "kv_cache_memory_bytes": 240 * MiB}
    assert kv_cache_engine_kwargs(qwen05, on_cpu=False, environ={}, **need) == {}
    # The option, on either platform.
    for on_cpu in (True, False):
        assert kv_cache_engine_kwargs(qwen05, on_cpu=on_cpu, size="2GiB", environ={}, **need) == {
            "kv_cache_memory_bytes": 2 * GiB}
    # vLLM's own conventions win: the engine argument, and VLLM_CPU_KVCACHE_SPACE on CPU.
    assert kv_cache_engine_kwargs(qwen05, on_cpu=True, size="2GiB", environ={},
                                  engine_kwargs={"kv_cache_memory_bytes": 123}, **need) == {}
    assert kv_cache_engine_kwargs(qwen05, on_cpu=True, environ={"VLLM_CPU_KVCACHE_SPACE": "1"},
                                  **need) == {}


@pytest.mark.parametrize("text,size", [
    ("536870912", 536870912), (536870912, 536870912), ("512MiB", 512 * MiB), ("2GiB", 2 * GiB),
    ("1.5GiB", 3 * GiB // 2), ("2 gib", 2 * GiB), ("2GB", 2 * 10**9), ("64KiB", 65536),
    ("100B", 100), (None, None), ("none", None)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "2GiBs", "-1", "0", "0.5", "1.5B", "GiB", True])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--vllm_kv_cache_memory {text!r}")
    assert "512MiB" in msg and "KiB, MiB, GiB" in msg


def test_options_are_checked_before_start_up(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN05))
    base = ["--model", str(tmp_path), "--reward_funcs", "countdown",
            "--dataset", os.path.join(ROOT, "megatron_grpo/data/builtin/countdown.jsonl")]
    cfg = parse_rlhf_args(base + ["--vllm_kv_cache_memory", "512MiB"])
    assert cfg.rollout.vllm_kv_cache_memory == "512MiB"
    assert parse_rlhf_args(base).rollout.vllm_kv_cache_memory is None
    with pytest.raises(ValueError, match=r"--vllm_kv_cache_memory '2 lots' is not a valid size"):
        parse_rlhf_args(base + ["--vllm_kv_cache_memory", "2 lots"])
    with pytest.raises(ValueError, match="both size the KV cache"):
        parse_rlhf_args(base + ["--vllm_kv_cache_memory", "1GiB", "--vllm_engine_kwargs",
                                '{"kv_cache_memory_bytes": 1000}'])
    server = parse_rollout_args(["--model", str(tmp_path), "--vllm_kv_cache_memory", "1GiB"])
    assert server.vllm_kv_cache_memory == "1GiB"
    with pytest.raises(ValueError, match=r"--vllm_kv_cache_memory '1 parsec'"):
        parse_rollout_args(["--model", str(tmp_path), "--vllm_kv_cache_memory", "1 parsec"])


def test_rollout_server_passes_bytes(tmp_path):
    """`megatron rollout` gives vLLM --kv-cache-memory-bytes on CPU, none on GPU."""
    from megatron_grpo.rollout.server import SERVER_SEQUENCES, vllm_cli_args

    (tmp_path / "config.json").write_text(json.dumps(QWEN05))
    cfg = parse_rollout_args(["--model", str(tmp_path), "--vllm_max_model_len", "1024"])
    argv = vllm_cli_args(cfg, on_cpu=True)
    expect = kv_cache_bytes(str(tmp_path), sequences=SERVER_SEQUENCES, max_model_len=1024)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(expect)
    assert "--kv-cache-memory-bytes" not in vllm_cli_args(cfg, on_cpu=False)
    cfg = parse_rollout_args(["--model", str(tmp_path), "--vllm_kv_cache_memory", "1GiB"])
    argv = vllm_cli_args(cfg, on_cpu=False)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(GiB)


# ------------------------------------------------------------------ the real engine, a small node
SMALL_NODE = dict(total_memory=4 * GiB, available_memory=512 * MiB)


def patch_node_probe(total_memory: int, available_memory: int) -> list:
    """Make vLLM's NUMA-node probe (`cpu_resource_utils.get_memory_node_info`, read
    from /sys/devices/system/node/nodeN/meminfo) report a node of this size, wherever
    vLLM's CPU modules bound it by name. Returns the modules patched."""
    import vllm.platforms.cpu  # noqa: F401 - the modules that import the probe by name
    import vllm.utils.cpu_resource_utils as cru
    import vllm.v1.worker.cpu.shm  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401

    original = cru.get_memory_node_info

    def small_node(node_id: int = 0):
        return cru.MemoryNodeInfo(total_memory=total_memory, available_memory=available_memory)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "get_memory_node_info", None) is original:
            module.get_memory_node_info = small_node
            patched.append(name)
    return patched


def _small_node_body(rank, world_size, model_dir):
    import psutil
    from vllm import LLM

    from bridge import load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.rollout.colocate import ColocateEngine
    from tests.test_rollout_colocate import PROMPTS, engine_kwargs

    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)    # not the user's convention: our path
    seen = {}
    # The process holds a Megatron model first, as a colocated trainer rank does.
    init_parallel(ParallelDims(world_size=1, tp=1))
    config, args = build_transformer_config(model_dir, tp=1)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, model_dir)
    seen["megatron_params"] = sum(p.numel() for c in chunks for p in c.parameters())
    seen["rss"] = psutil.Process().memory_info().rss

    seen["patched"] = patch_node_probe(**SMALL_NODE)
    # Control: vLLM's fraction path (serve's default 0.9 of the node) refuses this node.
    try:
        LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
            gpu_memory_utilization=0.9)
        seen["fraction_error"] = None
    except ValueError as e:
        seen["fraction_error"] = str(e)

    engine = ColocateEngine(model_dir, **engine_kwargs())
    seen["kv_bytes"] = engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
    seen["generate"] = [c.__dict__ for c in engine.generate(PROMPTS)]
    engine.close()
    return seen


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_engine_starts_on_a_small_node_beside_megatron(tmp_path):
    from tests.test_rollout_colocate import (PROMPTS, TEMPERATURE, engine_kwargs, hf_logprobs,
                                             max_diff, tiny_vllm_model, ATOL)

    model_dir = tiny_vllm_model(tmp_path / "m")
    [seen] = run_distributed(_small_node_body, world_size=1, args=(str(model_dir),),
                             timeout=300)
    assert {"vllm.v1.worker.cpu_worker", "vllm.platforms.cpu"} <= set(seen["patched"])
    assert seen["megatron_params"] > 0 and seen["rss"] > 0
    err = seen["fraction_error"]
    assert err is not None and "Available memory on node" in err and "/4.0 GiB" in err, err
    # The engine sized its cache in bytes from the run: 3 prompts x 2 completions.
    kw = engine_kwargs()
    assert seen["kv_bytes"] == kv_cache_bytes(
        str(model_dir), sequences=kw["num_generations"], max_model_len=kw["vllm_max_model_len"],
        dtype="float32")
    gen = seen["generate"]
    assert [c["prompt_index"] for c in gen] == [0, 0, 1, 1, 2, 2]
    ref = hf_logprobs(model_dir, [PROMPTS[c["prompt_index"]] for c in gen],
                      [c["token_ids"] for c in gen], TEMPERATURE)
    assert max_diff([c["logprobs"] for c in gen], ref) < ATOL
