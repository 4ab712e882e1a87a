"""Each built-in reward against values worked out by hand (or from the paper's formula)."""
import json
import math
import os

import pytest

from megatron_grpo.rewards import build_reward_funcs, score
from megatron_grpo.rewards.accuracy import Accuracy, Cosine
from megatron_grpo.rewards.countdown import countdown_reward, evaluate_expression
from megatron_grpo.rewards.format_reward import format_reward, react_format_reward
from megatron_grpo.rewards.math_reward import clean_latex, math_reward
from megatron_grpo.rewards.length import Repetition, SoftOverlong

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_format():
    cases = {
        "<think>a</think><answer>b</answer>": 1.0,
        "<think>line 1\nline 2</think>\n<answer>b</answer>": 1.0,
        "<think>a</think>  <answer>\n42\n</answer>": 1.0,
        "<think>a</think><answer>b</answer>\n": 0.0,           # nothing may follow </answer>
        "x<think>a</think><answer>b</answer>": 0.0,            # nothing may precede <think>
        "<answer>b</answer>": 0.0,
        "<think>a</think>": 0.0,
        "<think>a</think> so <answer>b</answer>": 0.0,         # only whitespace in between
        # ms-swift's pattern does not check nesting: its lazy `.*?` stretches to the last tag
        "<think>a</think><answer>b</answer><answer>c</answer>": 1.0,
        "<think>a<think>b</think><answer>c</answer>": 1.0,
        "\n<think>a</think><answer>b</answer>": 0.0,
        "": 0.0,
    }
    assert format_reward(list(cases)) == list(cases.values())


def test_react_format():
    cases = {
        "<think>look it up</think>\nAction: search\nAction Input: {\"q\": \"x\"}": 1.0,
        "<think>a\nb</think>Action: f\n\nthen Action Input:": 1.0,     # anything between them
        "<think>a</think>Action Input: {} Action: f": 0.0,              # Action: must come first
        "<think>a</think> well, Action: f Action Input: {}": 0.0,        # only whitespace before Action:
        "Action: f\nAction Input: {}": 0.0,                              # no <think>
        " <think>a</think>Action: f Action Input: {}": 0.0,             # must start with <think>
    }
    assert react_format_reward(list(cases)) == list(cases.values())


def test_math():
    completions = ["We get 42.\n# Answer\n\\boxed{42}",   # '# Answer', then the box
                   "so \\boxed{\\frac{1}{2}} done",          # first '}' ends the box: '\\frac{1'
                   "\\(x+1\\)",                              # delimiters dropped
                   "\\boxed{7}",
                   "no box, 7 and more"]
    truths = ["42", "\\frac{1", "<ignored># Answer x+1", "\\boxed{8}", "7"]
    assert math_reward(completions, ground_truths=truths) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert clean_latex("\\[\\frac{a}{b}}}\\]") == "\\fracab"
    assert math_reward(["\\boxed{3}"], solution=["3"]) == [1.0]      # `solution` when no ground_truths
    with pytest.raises(ValueError, match="ground_truths"):
        math_reward(["x"])


def test_math_uses_sympy_when_it_can_parse():
    try:
        from sympy.parsing.latex import parse_latex
        parse_latex("1")
    except Exception:  # sympy's LaTeX parser needs antlr4-python3-runtime 4.11
        pytest.skip("sympy's LaTeX parser is unavailable (antlr4 runtime != 4.11)")
    assert math_reward(["\\boxed{0.5}", "\\boxed{2x+2}"], ground_truths=["\\frac{1}{2}", "2(x+1)"]) == [1.0, 1.0]


def test_accuracy_with_math_verify():
    pytest.importorskip("math_verify")
    acc = Accuracy()
    completions = ["<think>7+5</think><answer>12</answer>",
                   "<answer>0.5</answer>",
                   "<answer>13</answer>",
                   "The answer is \\boxed{7}.",            # no tags: an anchored answer counts
                   "I think 7",                            # no tags, no anchor: not an answer
                   "<answer>Paris.</answer>",              # gold not math: normalised exact match
                   "<answer>12</answer>",
                   "<answer>\\frac{3}{6}</answer>"]
    solutions = ["12", "\\frac{1}{2}", "12", "7", "7", "paris", "<answer>12</answer>", 0.5]
    assert acc(completions, solution=solutions) == [1, 1, 0, 1, 0, 1, 1, 1]


def test_accuracy_fallback_without_math_verify():
    acc = Accuracy(use_math_verify=False)
    completions = ["<answer>12,000</answer>", "<answer>1/2</answer>", "<answer> $\\boxed{5}$ </answer>",
                   "<answer>Paris.</answer>", "<answer>3.0</answer>", "<answer>4</answer>"]
    solutions = ["12000", "0.5", "5", "paris", "3", "5"]
    assert acc(completions, solution=solutions) == [1, 0, 1, 1, 1, 0]


def _cosine_reference(t, T, v0, vL):
    # The paper's / ms-swift's form: r = max - (max - min) * (1 - cos(t pi / T)) / 2, max at t=0.
    return v0 - (v0 - vL) * (1 - math.cos(t * math.pi / T)) / 2


def test_cosine():
    cos = Cosine(max_len=100, accuracy=Accuracy(use_math_verify=False))
    right, wrong = "<answer>4</answer>", "<answer>5</answer>"
    lengths = [0, 25, 50, 100, 150]
    got_right = cos([right] * 5, solution=["4"] * 5, completion_lengths=lengths)
    got_wrong = cos([wrong] * 5, solution=["4"] * 5, completion_lengths=lengths)
    # past max_len (150) the cosine turns back, as ms-swift's: cos(1.5 pi) = 0 -> the midpoint
    assert got_right == pytest.approx([1.0, 0.5 + 0.25 * (1 + math.sqrt(0.5)), 0.75, 0.5, 0.75])
    assert got_wrong == pytest.approx([-0.5, -0.25 - 0.25 * math.sqrt(0.5), -0.25, 0.0, -0.25])
    assert got_right == pytest.approx([_cosine_reference(t, 100, 1.0, 0.5) for t in lengths])
    assert got_wrong == pytest.approx([_cosine_reference(t, 100, -0.5, 0.0) for t in lengths])
    with pytest.raises(ValueError, match="completion_lengths"):
        cos([right], solution=["4"])


def test_repetition():
    rep = Repetition(n_grams=3, max_penalty=-1.0)
    got = rep(["a b c a b c", "A b C a B c", "a b", "", "x y z w", "a a a a a"])
    # trigrams: abc bca cab abc -> 3 unique of 4 -> -(1 - 3/4); aaa x3 -> -(1 - 1/3)
    assert got == pytest.approx([-0.25, -0.25, 0.0, 0.0, 0.0, -2 / 3])
    assert Repetition(2, -0.5)(["a b a b"]) == pytest.approx([-0.5 * (1 - 2 / 3)])


def test_soft_overlong():
    soft = SoftOverlong(soft_max_length=100, soft_cache_length=20)
    got = soft(["x"] * 6, completion_lengths=[10, 80, 81, 90, 100, 110])
    # ms-swift: min(-(L - 80) / 20, 0), not floored at -1 past soft_max_length
    assert got == pytest.approx([0.0, 0.0, -1 / 20, -0.5, -1.0, -1.5])
    with pytest.raises(ValueError, match="soft_cache_length"):
        SoftOverlong(100, 100)


@pytest.mark.parametrize("answer, nums, target, expected", [
    ("3*5-2", [3, 5, 2], 13, 1.0),
    ("(3 * 5) - 2 = 13", [3, 5, 2], 13, 1.0),
    ("13 = 3*5-2", [3, 5, 2], 13, 1.0),
    ("(5-3)*2", [3, 5, 2], 13, 0.0),                 # wrong value
    ("3*5", [3, 5, 2], 15, 0.0),                     # 2 unused
    ("3*5-2+2", [3, 5, 2], 15, 0.0),                 # 2 used twice
    ("2/6*3", [2, 3, 6], 1, 1.0),                    # exact fractions: 1/3 * 3 = 1
    ("1/(5-5)", [5, 5, 1], 1, 0.0),                  # division by zero
    ("-2+3-1", [2, 3, 1], 0, 1.0),
    ("3**5", [3, 5], 243, 0.0),                      # only + - * /
    ("__import__('os').system('true')", [1], 1, 0.0),
    ("0x3*5-2", [3, 5, 2], 13, 0.0),
    ("13", [3, 5, 2], 13, 0.0),
    ("3 × 5 − 2", [3, 5, 2], 13, 0.0),               # unicode minus is not an operator
    ("3 × 5 - 2", [3, 5, 2], 13, 1.0),
])
def test_countdown(answer, nums, target, expected):
    completion = f"<think>try</think><answer>{answer}</answer>"
    assert countdown_reward([completion], nums=[nums], target=[target]) == [expected]


def test_countdown_needs_answer_tags_and_takes_the_last():
    assert countdown_reward(["3*5-2"], nums=[[3, 5, 2]], target=[13]) == [0.0]
    two = "<answer>3*5-2</answer> or <answer>1</answer>"
    assert countdown_reward([two], nums=[[3, 5, 2]], target=["13"]) == [0.0]
    assert evaluate_expression("1+" * 150 + "1") is None     # over the length limit


def test_builtin_countdown_solutions_score_one():
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "megatron_grpo", "data", "builtin",
                                                            "countdown.jsonl"))]
    assert len(rows) >= 300
    completions = [f"<think>x</think><answer>{r['solution']}</answer>" for r in rows]
    got = countdown_reward(completions, nums=[r["nums"] for r in rows], target=[r["target"] for r in rows])
    assert got == [1.0] * len(rows)
    assert all(len(r["nums"]) == 3 and max(r["nums"]) <= 9 and 1 <= r["target"] <= 50 for r in rows)


def test_built_from_config_parameters(tmp_path):
    from megatron_grpo.config import parse_rlhf_args

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = parse_rlhf_args(["--model", str(tmp_path / "m"),
                           "--dataset", os.path.join(ROOT, "megatron_grpo/data/builtin/arithmetic.jsonl"),
                           "--reward_funcs", "cosine", "repetition", "soft_overlong", "accuracy",
                           "--max_completion_length", "64", "--soft_cache_length", "16",
                           "--repetition_n_grams", "2", "--repetition_max_penalty", "-0.5",
                           "--cosine_min_len_value_correct", "2.0"])
    funcs = build_reward_funcs(cfg.reward.reward_funcs, cfg)
    assert funcs[0].fn.max_len == 64 and funcs[0].fn.correct == (2.0, 0.5)
    assert (funcs[1].fn.n, funcs[1].fn.max_penalty) == (2, -0.5)
    assert (funcs[2].fn.max_length, funcs[2].fn.cache_length) == (64, 16)
    out = score(funcs, ["<answer>4</answer>", "a b a b"],
                {"solution": ["4", "5"], "completion_lengths": [0, 56]})
    assert out.shape == (2, 4)
    assert out[0].tolist() == pytest.approx([2.0, 0.0, 0.0, 1.0])
    assert out[1].tolist() == pytest.approx([_cosine_reference(56, 64, -0.5, 0.0), -0.5 * (1 - 2 / 3),
                                             -0.5, 0.0])
