"""Chat messages -> the prompt string the engine samples from."""
from __future__ import annotations

from typing import Any, Dict, List

# Used when a tokenizer has no chat template (e.g. a tiny locally trained one).
FALLBACK_TEMPLATE = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant: "


def render_prompt(tokenizer: Any, messages: List[Dict[str, str]]) -> str:
    """The tokenizer's chat template with the generation prompt, or a plain fallback."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = "".join(FALLBACK_TEMPLATE.format(**m) for m in messages)
    return text + FALLBACK_GENERATION_PROMPT
