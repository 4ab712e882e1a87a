"""bridge/hf_checkpoint.py: the side files written beside exported weights name the
weights' dtype in config.json (a run trained in bf16 from a float32 checkpoint writes bf16
tensors: a loader taking the checkpoint's dtype must see bfloat16)."""
import json

import pytest
import torch

from bridge.hf_checkpoint import copy_hf_side_files


def _source(tmp_path, config):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    (src / "tokenizer.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    return src


@pytest.mark.parametrize("config, keys", [
    ({"model_type": "qwen2", "torch_dtype": "float32"}, [("torch_dtype",)]),
    ({"model_type": "qwen2", "torch_dtype": "float32", "dtype": "float32"},
     [("torch_dtype",), ("dtype",)]),
    ({"model_type": "qwen2"}, [("torch_dtype",)]),      # none named: torch_dtype added
    ({"model_type": "qwen2_vl", "torch_dtype": "float32",
      "text_config": {"torch_dtype": "float32", "hidden_size": 8}},
     [("torch_dtype",), ("text_config", "torch_dtype")]),
])
def test_side_files_name_the_weights_dtype(tmp_path, config, keys):
    src = _source(tmp_path, config)
    dst = tmp_path / "dst"
    copy_hf_side_files(str(src), str(dst), dtype=torch.bfloat16)
    out = json.loads((dst / "config.json").read_text())
    for path in keys:
        value = out
        for k in path:
            value = value[k]
        assert value == "bfloat16", path
    assert out["model_type"] == config["model_type"]
    assert (dst / "tokenizer.json").is_file() and not (dst / "model.safetensors").exists()


def test_side_files_without_a_dtype_are_copied_as_they_are(tmp_path):
    src = _source(tmp_path, {"model_type": "qwen2", "torch_dtype": "float32"})
    dst = tmp_path / "dst"
    copy_hf_side_files(str(src), str(dst))
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()


def test_side_files_already_naming_the_dtype_stay_byte_for_byte(tmp_path):
    src = _source(tmp_path, {"model_type": "qwen2", "dtype": "bfloat16", "torch_dtype": "bfloat16"})
    dst = tmp_path / "dst"
    copy_hf_side_files(str(src), str(dst), dtype=torch.bfloat16)
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
