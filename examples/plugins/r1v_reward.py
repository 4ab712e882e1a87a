"""`external_r1v_acc`: the accuracy reward of ms-swift's multimodal GRPO examples (its
examples/train/grpo/plugin/plugin.py registers one under this name), for
`--external_plugins examples/plugins/r1v_reward.py --reward_funcs external_r1v_acc`.

1.0 when the completion's answer equals the row's `solution`, else 0.0. The answer is what
an `<answer>...</answer>` block holds, else the whole completion; the solution is read the
same way. Two answers are equal as text (stripped), or as numbers when both are numbers
("3" and "3.0"). ms-swift's version tries math_verify's symbolic check first; this one
needs no extra package.
"""
import re

from megatron_grpo.rewards import register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _answer(text: str) -> str:
    match = _ANSWER.search(text)
    return (match.group(1) if match else text).strip()


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


@register_reward("external_r1v_acc")
def external_r1v_acc(completions, solution, **kwargs):
    return [1.0 if _same(_answer(c), _answer(str(s))) else 0.0
            for c, s in zip(completions, solution)]
