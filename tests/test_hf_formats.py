"""Checkpoints from outside, in both config.json formats, for every supported family.

Each family's tiny checkpoint is written by the installed transformers' `save_pretrained`
(the tools/ builders use it), then given two config.json files beside the same weights:
- "transformers": the config as the installed transformers saves it today (a
  vision-language model's text sizes under `text_config`, `rope_parameters`, Qwen3-MoE's
  `num_local_experts`);
- "hub": the flat layout of the published checkpoints, which older transformers wrote
  (Qwen2.5-VL-7B-Instruct's text sizes at the top with `rope_scaling: {"type": "mrope",
  "mrope_section": ...}`, Qwen3-30B-A3B's `num_experts`, `rope_theta`, `torch_dtype`).

On each: the sizes the project reads (the option checks' JSON view and the transformers
view the builder uses) against transformers' own config object; `megatron rlhf --dry_run`;
a bridge round trip (HF -> Megatron -> HF, every tensor equal to the checkpoint's); and
per family one GRPO step (the real trainer and vLLM engine) on one of the two formats, in
float32, where the trainer's log-probs of the sampled tokens must equal vLLM's, which
builds its model from the same config.json through transformers.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests import cli_zygote
from tests.harness import free_port, hf_tensors, run_distributed, run_together

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama")
VISION = ("qwen2_vl", "qwen2_5_vl")
FAMILIES = TEXT + VISION
FORMATS = ("transformers", "hub")
# The format of each family's GRPO step: each format gets a dense, an MoE and a VL family.
STEP_FORMAT = {"qwen2": "transformers", "qwen3": "hub", "llama": "transformers",
               "qwen2_moe": "hub", "qwen3_moe": "transformers", "qwen2_vl": "hub",
               "qwen2_5_vl": "transformers"}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _base_checkpoint(family: str, out: str) -> str:
    """A tiny checkpoint of `family` (head size 32, which vLLM-CPU's attention takes)."""
    if family in VISION:
        from tools.make_tiny_vl_model import make_tiny_vl_model

        return str(make_tiny_vl_model(out, family=family, hidden_size=64, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=128,
                                      vision_depth=1))
    from tools.make_tiny_model import make_tiny_model

    return str(make_tiny_model(out, family=family, num_layers=2, hidden_size=64,
                               num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=128, vocab_size=999,
                               head_dim=None if family in ("qwen2", "qwen2_moe") else 32,
                               moe=MOE if "moe" in family else None))


def _hub_config(saved: dict, family: str) -> dict:
    """`saved` (transformers' current format) as the published checkpoints' config.json."""
    text = saved.get("text_config") or {}
    flat = {k: v for k, v in saved.items() if k not in (
        "text_config", "rope_parameters", "dtype", "num_local_experts", "layer_types")}
    for key, value in text.items():
        if key not in ("rope_parameters", "model_type", "dtype", "layer_types"):
            flat.setdefault(key, value)
    rope = text.get("rope_parameters") or saved.get("rope_parameters") or {}
    flat["rope_theta"] = rope.get("rope_theta", 10000.0)
    flat["rope_scaling"] = ({"type": "mrope", "mrope_section": rope["mrope_section"]}
                            if "mrope_section" in rope else None)
    experts = saved.get("num_local_experts") or saved.get("num_experts")
    if experts:
        flat["num_experts"] = experts
    flat["torch_dtype"] = saved.get("dtype") or text.get("dtype") or "float32"
    flat["transformers_version"] = "4.51.0"
    if "vision_config" in saved:
        vision = {k: v for k, v in saved["vision_config"].items()
                  if k not in ("model_type", "rope_parameters", "initializer_range")}
        if family == "qwen2_5_vl":   # the released file's name for the input channels
            vision["in_chans"] = vision.pop("in_channels", 3)
        flat["vision_config"] = vision
    return flat


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, format) -> a checkpoint folder; the weights of both formats are the same."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("formats")
    out = {}
    for family in FAMILIES:
        base = _base_checkpoint(family, str(root / family / "base"))
        for fmt in FORMATS:
            path = str(root / family / fmt)
            shutil.copytree(base, path)
            os.remove(os.path.join(path, "config.json"))
            AutoConfig.from_pretrained(base).save_pretrained(path)
            if fmt == "hub":
                file = os.path.join(path, "config.json")
                with open(file) as f:
                    saved = json.load(f)
                with open(file, "w") as f:
                    json.dump(_hub_config(saved, family), f, indent=2)
            out[family, fmt] = path
    return out


def _expected(path: str) -> dict:
    """The sizes transformers' own config object of `path` names."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    return dict(
        architecture=config.architectures[0], layers=text.num_hidden_layers,
        hidden=text.hidden_size, heads=heads, kv_heads=text.num_key_value_heads,
        vocab=text.vocab_size, ffn=text.intermediate_size,
        head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
        max_len=text.max_position_embeddings, rope_theta=float(rope["rope_theta"]),
        mrope_section=rope.get("mrope_section"), tied=bool(config.tie_word_embeddings),
        experts=getattr(text, "num_experts", None) or getattr(text, "num_local_experts", 0) or 0,
        moe=(getattr(text, "num_experts_per_tok", None), getattr(text, "moe_intermediate_size", None),
             getattr(text, "norm_topk_prob", None),
             getattr(text, "shared_expert_intermediate_size", None)),
        vision=getattr(config, "vision_config", None))


@pytest.mark.slow      # 14 checkpoints built, Megatron imported
def test_formats_are_read_as_transformers_reads_them(checkpoints):
    """The files are in the format named, and what the option checks (JSON view) and the
    model builder (transformers view) take from them is what transformers' config says."""
    from megatron_grpo.config.hf_model import head_dim, json_config, model_max_len, num_experts
    from megatron_grpo.config.validate import model_trains_in_bf16
    from megatron_grpo.model import build_transformer_config

    for (family, fmt), path in checkpoints.items():
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        vision = family in VISION
        if fmt == "transformers":
            assert ("text_config" in raw) == vision and "rope_parameters" in (
                raw.get("text_config") or raw), (family, raw)
            assert "num_hidden_layers" not in raw or not vision
            if family == "qwen3_moe":
                assert "num_local_experts" in raw and "num_experts" not in raw
        else:
            assert "text_config" not in raw and "num_hidden_layers" in raw
            assert "rope_theta" in raw and "rope_parameters" not in raw
            assert (raw["rope_scaling"] or {}).get("mrope_section") == ([4, 6, 6] if vision
                                                                        else None)
            assert ("num_experts" in raw) == ("moe" in family)
        want = _expected(path)
        where = f"{family} ({fmt})"
        assert head_dim(path) == want["head_size"] == 32, where
        assert model_max_len(path) == want["max_len"], where
        assert num_experts(json_config(path)) == want["experts"], where
        assert model_trains_in_bf16(path) is False, where
        config, args = build_transformer_config(path)
        assert args.family.name == family, where
        assert (config.num_layers, config.hidden_size, config.num_attention_heads,
                config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (
            want["layers"], want["hidden"], want["heads"], want["kv_heads"], want["head_size"],
            want["ffn"]), where
        assert (args.vocab_size, args.rotary_base, args.tie_word_embeddings,
                args.max_sequence_length) == (want["vocab"], want["rope_theta"], want["tied"],
                                              want["max_len"]), where
        assert (config.num_moe_experts or 0) == want["experts"], where
        if want["experts"]:
            topk, ffn, norm_topk, shared = want["moe"]
            assert (config.moe_router_topk, config.moe_ffn_hidden_size,
                    config.moe_router_pre_softmax, config.moe_shared_expert_intermediate_size) \
                == (topk, ffn, not norm_topk, shared), where
        assert getattr(config, "mrope_section", None) == want["mrope_section"], where
        if vision:
            assert args.hf_config["vision_config"]["depth"] == want["vision"].depth == 1, where


# Configs that leave sizes to transformers' per-class defaults (a Qwen3's head_dim 128,
# Qwen2-VL's rope_theta 1e6 and rms_norm_eps 1e-5), which a reader of the raw keys misses.
MINIMAL = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 999},
    "qwen2_vl": {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                 "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                 "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 999,
                 "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                 "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 256}},
}


@pytest.mark.parametrize("family", list(MINIMAL))
def test_sizes_left_to_transformers_defaults(family, tmp_path):
    """A config.json without the sizes its transformers class defaults builds the model
    transformers (and vLLM) build from it."""
    from megatron_grpo.model import build_transformer_config

    (tmp_path / "config.json").write_text(json.dumps(MINIMAL[family]))
    want = _expected(str(tmp_path))
    config, args = build_transformer_config(str(tmp_path))
    text = _text_config(str(tmp_path))
    assert (config.kv_channels, args.rotary_base, config.layernorm_epsilon,
            args.max_sequence_length) == (want["head_size"], want["rope_theta"],
                                          text.rms_norm_eps, want["max_len"])


def _text_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).get_text_config()


@pytest.mark.slow
def test_dry_run_on_every_format(checkpoints, tmp_path):
    """`megatron rlhf --dry_run true` passes on each checkpoint and prints transformers'
    sizes of it."""
    data = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "arithmetic.jsonl")
    commands = {}
    for (family, fmt), path in checkpoints.items():
        argv = ["--rlhf_type", "grpo", "--dry_run", "true", "--model", path, "--dataset", data,
                "--reward_funcs", "accuracy", "--num_generations", "2",
                "--global_batch_size", "2", "--micro_batch_size", "1",
                "--max_completion_length", "4", "--vllm_max_model_len", "128",
                "--report_to", "none", "--output_dir", str(tmp_path / family / fmt)]
        commands[family, fmt] = (cli_zygote.command("rlhf", *argv),
                                 cli_zygote.env(NPROC_PER_NODE="1"))
    results = run_together(commands, cwd=ROOT, timeout=300)
    for (family, fmt), r in results.items():
        path = checkpoints[family, fmt]
        assert r.returncode == 0, (family, fmt, r.stderr[-3000:])
        want = _expected(path)
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith("model "))
        assert (f"{path}: {family} ({want['architecture']}), {want['layers']} layers, hidden "
                f"{want['hidden']}, {want['heads']} heads, {want['kv_heads']} kv heads, vocab "
                f"{want['vocab']}, float32") in line, (family, fmt, line)
        assert "memory plan (per rank" in r.stdout, (family, fmt, r.stdout)


def _roundtrips(rank, world_size, checkpoints):
    """HF -> Megatron -> HF of every checkpoint on 2 ranks: TP 2 (1 kv head: replicated on
    load, de-duplicated on export), the MoE families at EP 2 (2 of the 4 experts a rank).
    (family, format) -> (names exported in order, names whose tensor differs)."""
    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    out, layout = {}, None
    for (family, fmt), path in sorted(checkpoints.items(), key=lambda kv: "moe" in kv[0][0]):
        moe = "moe" in family
        dims = dict(tp=1, ep=2) if moe else dict(tp=2)
        if dims != layout:
            init_parallel(ParallelDims(world_size=world_size, **dims))
            layout = dims
        config, args = build_transformer_config(path, **dims)
        chunks = build_model(config, args)
        with torch.no_grad():
            for chunk in chunks:      # garbage first: a tensor the load skips shows
                for p in chunk.parameters():
                    p.fill_(float("nan"))
        load_hf_weights(chunks, config, args, path)
        ref = hf_tensors(path)
        names, wrong = [], []
        for bucket in export_hf_weights(chunks, config, args, bucket_size_bytes=64 << 10):
            for name, tensor in bucket:
                names.append(name)
                if name not in ref or tensor.dtype != ref[name].dtype or \
                        not torch.equal(tensor, ref[name]):
                    wrong.append(name)
        out[family, fmt] = (names, wrong, sorted(ref))
    return out


@pytest.mark.slow
def test_bridge_roundtrip_on_every_format(checkpoints):
    results = run_distributed(_roundtrips, world_size=2, args=(checkpoints,), timeout=300)
    for key in checkpoints:
        for rank in results:
            names, wrong, expected = rank[key]
            assert sorted(names) == expected and len(names) == len(set(names)), \
                (key, sorted(set(expected) - set(names)), sorted(set(names) - set(expected)))
            assert not wrong, (key, wrong)
        assert results[0][key][0] == results[1][key][0], key      # one stream on every rank


@pytest.fixture(scope="module")
def image_data(tmp_path_factory):
    from tools.make_vl_count_data import main as make_count_data

    return make_count_data(["--out_dir", str(tmp_path_factory.mktemp("count")), "--n", "2"])


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step(family, checkpoints, image_data, tmp_path):
    """One GRPO step on one process with a colocated vLLM engine, in float32: the trainer's
    log-probs of vLLM's samples equal vLLM's own (rollout_correction/kl ~ 0), both models
    built from the same config.json, ours through the project's reader, vLLM's through
    transformers."""
    import subprocess

    path = checkpoints[family, STEP_FORMAT[family]]
    if family in VISION:
        task = ["--dataset", image_data, "--reward_funcs", "accuracy"]
    else:
        task = ["--dataset", os.path.join(ROOT, "megatron_grpo/data/builtin/arithmetic.jsonl"),
                "--reward_funcs", "digits", "--external_plugins",
                os.path.join(ROOT, "examples/plugins/digits_reward.py")]
    out = str(tmp_path / "out")
    argv = ["--rlhf_type", "grpo", "--model", path, *task, "--num_generations", "2",
            "--generation_batch_size", "2", "--global_batch_size", "2", "--micro_batch_size", "2",
            "--max_completion_length", "4", "--train_iters", "1", "--lr", "1e-3", "--beta", "0",
            "--bf16", "false", "--use_vllm", "true", "--vllm_mode", "colocate",
            "--vllm_max_model_len", "128", "--vllm_enforce_eager", "true", "--temperature", "1.0",
            "--log_rollout_offpolicy_metrics", "true", "--log_completions", "false",
            "--report_to", "none", "--save_steps", "1000", "--seed", "7", "--output_dir", out]
    env = cli_zygote.env(NPROC_PER_NODE="1", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    r = subprocess.run(cli_zygote.command("rlhf", *argv), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [row["step"] for row in rows] == [1], rows
    row = rows[0]
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), row
    assert abs(row["rollout_correction/kl"]) < 1e-4, row
    assert os.path.isfile(os.path.join(out, "final_hf", "config.json"))
