"""--enable_thinking reaches the chat template (tiny Qwen3: a hybrid-thinking template)."""
from megatron_grpo.data import render_prompt
from tools.make_tiny_model import make_tiny_model

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
OPEN = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_enable_thinking_qwen3(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "q", family="qwen3"))
    assert render_prompt(tok, MESSAGES, enable_thinking=True).endswith(OPEN)
    assert render_prompt(tok, MESSAGES, enable_thinking=False).endswith(OPEN + EMPTY_THINK)
    # ms-swift's default for a hybrid-thinking template: thinking off.
    assert render_prompt(tok, MESSAGES) == render_prompt(tok, MESSAGES, enable_thinking=False)


def test_template_without_the_switch_unchanged(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "l", family="llama",
                                                        vocab_size=999))
    plain = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert render_prompt(tok, MESSAGES) == plain
