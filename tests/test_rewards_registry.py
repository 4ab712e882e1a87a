"""Reward registry, plugin files, and `score` (shape, None, failures that name the sample)."""
import math
import os
import textwrap
import uuid

import pytest
import torch

from megatron_grpo.config import parse_rlhf_args
from megatron_grpo.rewards import (RewardFunc, RewardFunctionError, build_reward_funcs, load_plugins,
                                   register_reward, registered_names, score)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARITH = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "arithmetic.jsonl")


def unique(prefix):
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_plugin_file_registers_through_the_cli(tmp_path):
    fn_name, cls_name, swift_name = unique("longer"), unique("keyword"), unique("swift")
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(textwrap.dedent(f"""
        from megatron_grpo.rewards import ORM, orms, register_reward

        @register_reward("{fn_name}")
        def longer(completions, **kwargs):
            return [len(c) / 10 for c in completions]

        @register_reward("{cls_name}")
        class Keyword:
            def __init__(self, config=None):
                self.word = "yes" if config is None else config.data.system
            def __call__(self, completions, solution, **kwargs):
                return [float(self.word in c) + float(s == "1") for c, s in zip(completions, solution)]

        class SwiftStyle(ORM):                       # ms-swift's plugin idiom
            def __call__(self, completions, **kwargs):
                return [None if c == "skip" else 1.0 for c in completions]
        orms["{swift_name}"] = SwiftStyle
    """))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = parse_rlhf_args(["--model", str(tmp_path / "m"), "--dataset", ARITH,
                           "--external_plugins", str(plugin), "--system", "magic",
                           "--reward_funcs", fn_name, cls_name, swift_name, "format"])
    assert {fn_name, cls_name, swift_name} <= set(registered_names())
    load_plugins([str(plugin)])                     # importing twice is a no-op, not a clash
    funcs = build_reward_funcs(cfg.reward.reward_funcs, cfg)
    assert [f.name for f in funcs] == [fn_name, cls_name, swift_name, "format"]
    out = score(funcs, ["a magic word", "skip"], {"solution": ["1", "2"]})
    assert out.dtype == torch.float32 and out.shape == (2, 4)
    assert out[0].tolist() == pytest.approx([1.2, 2.0, 1.0, 0.0])
    assert out[1, :2].tolist() == pytest.approx([0.4, 0.0])
    assert math.isnan(out[1, 2].item())             # None: the reward does not apply


def test_plugin_import_error_names_the_file(tmp_path):
    bad = tmp_path / "broken_plugin.py"
    bad.write_text("import nonexistent_module_xyz\n")
    with pytest.raises(ValueError, match="broken_plugin.py' failed to import: ModuleNotFoundError"):
        load_plugins([str(bad)])


def test_name_clash_and_bad_registration():
    name = unique("clash")
    register_reward(name)(lambda completions, **kw: [0.0] * len(completions))
    with pytest.raises(ValueError, match=f"{name!r} is already registered"):
        register_reward(name)(lambda completions, **kw: [1.0] * len(completions))
    register_reward(name, override=True)(lambda completions, **kw: [1.0] * len(completions))
    with pytest.raises(ValueError, match="not callable"):
        register_reward(unique("x"))(42)
    with pytest.raises(ValueError, match="not a registered reward function"):
        build_reward_funcs(["no_such_reward"])


def _fragile(completions, solution, **kwargs):
    return [1.0 / int(s) for s in solution]         # ZeroDivisionError on solution "0"


def test_failure_names_function_and_sample():
    completions = ["first answer", "second answer", "the third completion " + "x" * 300]
    with pytest.raises(RewardFunctionError) as e:
        score([RewardFunc("fragile", _fragile)], completions, {"solution": ["1", "2", "0"],
                                                               "target": [7, 8, 9]})
    msg = str(e.value)
    assert "reward function 'fragile' raised ZeroDivisionError" in msg
    assert "sample 2" in msg and "'the third completion xxx" in msg and "..." in msg
    assert "'solution': '0'" in msg and "'target': 9" in msg
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_failure_only_on_the_whole_batch():
    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("needs one at a time")
        return [0.0]
    with pytest.raises(RewardFunctionError, match="'batch_only' raised RuntimeError.*each sample alone passed"):
        score([batch_only], ["a", "b"], {})


@pytest.mark.parametrize("result, pattern", [
    ([1.0], r"'bad' returned 1 values for 2 completions"),
    ([1.0, "high"], r"'bad' returned 'high' \(not a number\) for sample 1: completion 'b'"),
    (7, r"'bad' returned int, expected a list of 2 floats"),
])
def test_bad_return_values(result, pattern):
    with pytest.raises(RewardFunctionError, match=pattern):
        score([RewardFunc("bad", lambda completions, **kw: result)], ["a", "b"], {})


def test_score_checks_columns_and_accepts_tensors():
    with pytest.raises(ValueError, match="column 'solution' has 1 values for 2 completions"):
        score([RewardFunc("f", lambda c, **kw: [0.0] * len(c))], ["a", "b"], {"solution": ["1"]})
    out = score([RewardFunc("t", lambda c, **kw: torch.tensor([0.5, 2.0]))], ["a", "b"])
    assert out[:, 0].tolist() == [0.5, 2.0]
    assert score([], ["a", "b"]).shape == (2, 0)
