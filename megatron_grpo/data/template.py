"""Chat messages -> the prompt string the engine samples from."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

# Used when a tokenizer has no chat template (e.g. a tiny locally trained one).
FALLBACK_TEMPLATE = "{role}: {content}\n"
FALLBACK_GENERATION_PROMPT = "assistant: "


def render_prompt(tokenizer: Any, messages: List[Dict[str, str]],
                  enable_thinking: Optional[bool] = None) -> str:
    """The tokenizer's chat template with the generation prompt, or a plain fallback.

    `enable_thinking` (--enable_thinking) goes to the template as a variable. None is
    ms-swift's default: false for a hybrid-thinking template (one that reads the variable,
    as Qwen3's: the answer then opens with an empty think block), and nothing for the
    others, whose own behaviour stands.
    """
    return render_chat(tokenizer, messages, add_generation_prompt=True,
                       enable_thinking=enable_thinking)


def render_chat(tokenizer: Any, messages: List[Dict[str, str]], *, add_generation_prompt: bool,
                enable_thinking: Optional[bool] = None) -> str:
    """`render_prompt` with or without the generation prompt (multi-turn rollouts render
    a conversation that ends with the model's turn, to find what later messages add)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        extra = {}
        if enable_thinking is not None:
            extra["enable_thinking"] = enable_thinking
        elif isinstance(template, str) and "enable_thinking" in template:
            extra["enable_thinking"] = False
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    text = "".join(FALLBACK_TEMPLATE.format(**m) for m in messages)
    return text + (FALLBACK_GENERATION_PROMPT if add_generation_prompt else "")
