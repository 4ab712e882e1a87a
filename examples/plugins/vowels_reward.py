"""An example reward plugin (`--external_plugins examples/plugins/vowels_reward.py
--reward_funcs vowels`).

`vowels`: the fraction of a completion's characters that are vowels (a, e, i, o, u, either
case). It varies across any text, random text included, so every group of completions
has a spread and every step trains.

Why beside `digits` (digits_reward.py): a randomly initialised model over a real-size
vocabulary (tools/bench_peer.py's `real` shape: Qwen2.5-0.5B's architecture, a 151,665-
token tokenizer) almost never samples one of the ten digit tokens, so `digits` is 0 for
every completion, every advantage is 0, and a step computes a loss of 0 and no gradient:
a benchmark would time steps that train nothing. Its completions' vowel fractions spread
over ~0.27-0.35 within a prompt's group.
"""
from megatron_grpo.rewards import register_reward

VOWELS = frozenset("aeiouAEIOU")


@register_reward("vowels")
def vowels(completions, **kwargs):
    return [sum(ch in VOWELS for ch in c) / max(len(c), 1) for c in completions]
