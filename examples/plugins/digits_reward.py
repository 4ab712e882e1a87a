"""An example reward plugin (`--external_plugins examples/plugins/digits_reward.py`).

`digits`: the fraction of a completion's characters that are digits. A dense signal
that a tiny randomly initialised model can climb within minutes on a CPU, which is
what the CPU quickstart needs to show GRPO working end to end.
"""
from megatron_grpo.rewards import register_reward


@register_reward("digits")
def digits(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
