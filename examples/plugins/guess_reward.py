"""A reward plugin for the number-guessing environment (`--gym_env guess_number
--external_plugins examples/plugins/guess_reward.py --reward_funcs guess_format`).

`guess_format`, per trajectory, from the model's own turns (the assistant messages):

    1.0    a turn holds a guess the environment reads, <guess>N</guess> (it answered
           higher, lower or correct)
    0.25   otherwise, for each of the two markers the model's turns hold (0, 0.25, 0.5)

Shaping for a model that starts from nothing, as tool_call_reward.py: the environment's
own reward (gym_reward: 1 for the right number) needs a valid guess first, which a
random model almost never writes. Use both: --reward_funcs guess_format gym_reward.
"""
from megatron_grpo.multi_turn.builtin import GUESS
from megatron_grpo.rewards import register_reward

MARKERS = ("<guess>", "</guess>")


def _score(messages):
    said = [m.get("content") or "" for m in messages or [] if m.get("role") == "assistant"]
    if any(GUESS.search(text) for text in said):
        return 1.0
    return 0.25 * sum(any(marker in text for text in said) for marker in MARKERS)


@register_reward("guess_format")
def guess_format(completions, messages=None, **kwargs):
    if messages is None:                 # single-turn: the completion is the model's only turn
        messages = [[{"role": "assistant", "content": c}] for c in completions]
    return [_score(m) for m in messages]
