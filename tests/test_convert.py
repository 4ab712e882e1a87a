"""`megatron export` (megatron_grpo/convert.py): HF -> Megatron dist checkpoint at TP=2 -> HF at TP=1
and at PP=2 reproduces the original checkpoint bit for bit; the precision check prints the
logit difference; an existing output is kept without --overwrite.

One 2-rank gloo world runs every conversion the way torchrun would run `convert.main`
in each rank. Argument checks that need no processes run here directly.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest
import torch

from megatron_grpo.convert import check_args
from tests.harness import run_distributed


def _tensors(path):
    from tests.harness import hf_tensors as _hf_tensors

    return _hf_tensors(path)


def _world(rank, world_size, hf, root):
    from megatron_grpo.convert import main

    mcore, out_tp1, out_pp2 = (os.path.join(root, n) for n in ("mcore", "hf_tp1", "hf_pp2"))
    logs = {}

    def run(name, argv):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(argv)
        logs[name] = buf.getvalue()

    run("to_mcore", ["--to_mcore", "true", "--model", hf, "--output_dir", mcore,
                     "--tensor_model_parallel_size", "2", "--test_convert_precision", "true"])
    try:  # the folder holds a checkpoint now
        main(["--to_mcore", "true", "--model", hf, "--output_dir", mcore,
              "--tensor_model_parallel_size", "2"])
        logs["no_overwrite"] = "no error"
    except ValueError as e:
        logs["no_overwrite"] = str(e)
    run("to_hf_tp1", ["--to_hf", "true", "--mcore_model", mcore, "--output_dir", out_tp1,
                      "--test_convert_precision", "true"])
    run("to_hf_pp2", ["--to_hf", "true", "--mcore_model", mcore, "--output_dir", out_pp2,
                      "--pipeline_model_parallel_size", "2", "--max_shard_size", "100KB"])
    run("to_hf_cp2", ["--to_hf", "true", "--mcore_model", mcore, "--output_dir",
                      os.path.join(root, "hf_cp2"), "--context_parallel_size", "2"])
    run("overwrite", ["--to_hf", "true", "--mcore_model", mcore, "--output_dir", out_tp1,
                      "--overwrite", "true"])
    # A bf16 checkpoint of a float32 model: --to_hf without --torch_dtype writes its bf16
    # weights (not the HF config's float32).
    run("to_mcore_bf16", ["--to_mcore", "true", "--model", hf, "--output_dir",
                          os.path.join(root, "mcore_bf16"), "--torch_dtype", "bfloat16"])
    run("to_hf_bf16", ["--to_hf", "true", "--mcore_model", os.path.join(root, "mcore_bf16"),
                       "--output_dir", os.path.join(root, "hf_bf16")])
    return logs


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("convert")
    # Tied embeddings (PP=2 puts a copy on the last stage), qk norms, 2 kv heads.
    hf = make_tiny_model(root / "hf", family="qwen3", num_layers=4, num_key_value_heads=2,
                         vocab_size=999, tie_word_embeddings=True)
    logs = run_distributed(_world, world_size=2, args=(str(hf), str(root)), timeout=300)
    return hf, root, logs


def test_to_mcore_then_to_hf_reproduces_the_checkpoint(converted):
    hf, root, logs = converted
    want = _tensors(hf)
    assert os.path.isfile(root / "mcore" / "hf_config" / "config.json")
    for out in ("hf_tp1", "hf_pp2"):
        got = _tensors(root / out)
        assert list(got) and sorted(got) == sorted(want), out
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (out, name)
        for side in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (root / out / side).read_bytes() == (hf / side).read_bytes(), (out, side)
    index = json.loads((root / "hf_pp2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # 100KB shards
    assert not os.path.exists(root / "hf_tp1.tmp")


def test_to_hf_writes_the_checkpoint_dtype(converted):
    hf, root, _ = converted
    want, got = _tensors(hf), _tensors(root / "hf_bf16")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert tensor.dtype == torch.float32 and got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    config = json.loads((root / "hf_bf16" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"


def test_convert_precision_and_overwrite(converted):
    _, _, logs = converted
    for name in ("to_mcore", "to_hf_tp1"):
        m = re.search(r"max_abs_diff=(\S+) mean_abs_diff=(\S+)", logs[0][name])
        assert m, logs[0][name]
        assert float(m.group(1)) <= 1e-4 and float(m.group(2)) <= float(m.group(1))
    for rank_logs in logs:  # every rank refuses, none writes
        assert "--overwrite true" in rank_logs["no_overwrite"]
    assert "megatron export: wrote" in logs[0]["overwrite"]


def test_check_args_errors(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    base = ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="exactly one of --to_mcore true / --to_hf true"):
        check_args(["--to_mcore", "true", "--to_hf", "true", "--model", str(hf)] + base, 1)
    with pytest.raises(ValueError, match="--model .*not a folder"):
        check_args(["--to_mcore", "true", "--model", str(tmp_path / "nope")] + base, 1)
    with pytest.raises(ValueError, match="world size 3 .* is not divisible by --tensor_model_parallel_size 2"):
        check_args(["--to_mcore", "true", "--model", str(hf), "--tensor_model_parallel_size", "2"]
                   + base, 3)
    with pytest.raises(ValueError, match="neither a folder written by `megatron export --to_mcore`"):
        check_args(["--to_hf", "true", "--mcore_model", str(hf)] + base, 1)
    # A --to_mcore folder without the dist checkpoint's metadata: no layout to check here
    # (kv heads < TP: tests/test_checkpoint_reshard.py), any TP is accepted before start-up.
    mcore = tmp_path / "mcore"
    (mcore / "hf_config").mkdir(parents=True)
    (mcore / "hf_config" / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 1,
         "hidden_size": 64}))
    (mcore / "megatron_grpo_convert.json").write_text(json.dumps({"tensor_model_parallel_size": 2}))
    for tp in (1, 2):
        check_args(["--to_hf", "true", "--mcore_model", str(mcore), "--tensor_model_parallel_size",
                    str(tp)] + base, 2)
    # Options the chosen direction would ignore are refused, by name.
    with pytest.raises(ValueError, match=r"--mcore_model .*: not used by this export "
                                         r"\(--to_mcore reads --model\)"):
        check_args(["--to_mcore", "true", "--model", str(hf), "--mcore_model", str(mcore)]
                   + base, 1)
    with pytest.raises(ValueError, match="--model .*, --merge_lora true: not used by this export "
                                         r"\(--to_hf of a checkpoint without LoRA adapters\)"):
        check_args(["--to_hf", "true", "--mcore_model", str(mcore), "--model", str(hf),
                    "--merge_lora", "true"] + base, 1)
    # A vision-language model's logits are not transformers' AutoModelForCausalLM's.
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    with pytest.raises(ValueError, match="--test_convert_precision true compares text-only"):
        check_args(["--to_mcore", "true", "--model", str(hf), "--test_convert_precision",
                    "true"] + base, 1)


def test_to_hf_under_context_parallelism(converted):
    """CP shards activations only: a CP=2 conversion writes the original tensors."""
    hf, root, _ = converted
    original, cp2 = _tensors(hf), _tensors(root / "hf_cp2")
    assert original.keys() == cp2.keys()
    for k in original:
        assert torch.equal(original[k], cp2[k]), k
