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


# An ms-swift reward plugin as its users write it (ms-swift's docs' idiom); only line 1 differs.
SWIFT_PLUGIN = '''\
{import_line}
import asyncio


class LengthBudget(ORM):
    """Reads its options as ms-swift plugins do: flat names on self.args."""

    def __init__(self, args=None, **kwargs):
        super().__init__(args, **kwargs)
        self.budget = args.max_completion_length if args is not None else 10

    def __call__(self, completions, solution, **kwargs):
        return [float(len(c) <= self.budget) + float(s in c) for c, s in zip(completions, solution)]


class SlowJudge(AsyncORM):
    async def __call__(self, completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5 if "?" in c else None for c in completions]


orms["{budget}"] = LengthBudget
orms["{judge}"] = SlowJudge
'''


def test_ms_swift_plugin_needs_only_its_import_line_changed(tmp_path):
    budget, judge = unique("budget"), unique("judge")
    plugin = tmp_path / "swift_plugin.py"
    plugin.write_text(SWIFT_PLUGIN.format(import_line="from megatron_grpo.rewards import AsyncORM, ORM, orms",
                                          budget=budget, judge=judge))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = parse_rlhf_args(["--model", str(tmp_path / "m"), "--dataset", ARITH, "--max_completion_length", "5",
                           "--external_plugins", str(plugin), "--reward_funcs", budget, judge])
    funcs = build_reward_funcs(cfg.reward.reward_funcs, cfg)
    assert funcs[0].fn.args.max_completion_length == 5 and funcs[0].fn.args.model == str(tmp_path / "m")
    out = score(funcs, ["12", "why 12?", "far too long"], {"solution": ["12", "12", "3"]})
    assert out[:, 0].tolist() == [2.0, 1.0, 0.0]
    assert math.isnan(out[0, 1].item()) and out[1, 1].item() == 0.5 and math.isnan(out[2, 1].item())


@pytest.mark.parametrize("import_line, fix", [
    ("from swift.rewards import ORM, orms, AsyncORM", "`from megatron_grpo.rewards import ORM, orms, AsyncORM`"),
    ("from swift.plugin import ORM, orms as table", "`from megatron_grpo.rewards import ORM, orms as table`"),
    ("import swift.llm", "megatron-grpo has no swift.llm; remove it"),
])
def test_plugin_importing_swift_gets_a_one_line_fix(tmp_path, import_line, fix):
    plugin = tmp_path / "old_plugin.py"
    plugin.write_text("# my reward\n\n" + SWIFT_PLUGIN.format(import_line=import_line, budget="b", judge="j"))
    with pytest.raises(ValueError) as e:
        load_plugins([str(plugin)])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"--external_plugins {plugin}:3: `{import_line}` imports ms-swift; ")
    assert fix in msg
    assert "b" not in registered_names()        # refused before anything ran
