"""A reward plugin for the calculator scheduler (`--external_plugins
examples/plugins/tool_call_reward.py --reward_funcs tool_call_format`).

`tool_call_format`, per trajectory, from what happened in it:

    1.0    the tool ran and answered a number: a model turn ended (its stop token)
           holding a well-formed <tool_call>EXPR</tool_call>, and the calculator's tool
           message that followed is a value
    0.75   the tool ran but answered an error (EXPR did not parse: empty, words, ...)
    0.25   otherwise, for each of the two markers the model's turns hold (0, 0.25 or
           0.5; the assistant messages only: the system prompt's example does not count)

The partial credit is shaping for a model that starts from nothing: a randomly
initialised model writes one marker now and then (when each is a single token, as
`<tool_call>` is in Qwen2.5's vocabulary), almost never a whole call followed by its
stop token, so a reward for the tool running alone would be zero for nearly every group
and GRPO would have nothing to compare. Markers without a finished call earn at most 0.5.
"""
from megatron_grpo.rewards import register_reward

MARKERS = ("<tool_call>", "</tool_call>")


def _score(messages):
    messages = messages or []
    answers = [b.get("content") or "" for a, b in zip(messages, messages[1:])
               if a.get("role") == "assistant" and b.get("role") == "tool"]
    if answers:
        values = [line for text in answers for line in text.splitlines()
                  if not line.startswith("error")]
        return 1.0 if values else 0.75
    said = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
    return 0.25 * sum(any(marker in text for text in said) for marker in MARKERS)


@register_reward("tool_call_format")
def tool_call_format(completions, messages=None, **kwargs):
    if messages is None:                 # single-turn: the completion is the model's only turn
        messages = [[{"role": "assistant", "content": c}] for c in completions]
    return [_score(m) for m in messages]
