"""Prompt datasets: file formats, prompt column variants, #N sampling, errors, builtins."""
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from megatron_grpo.data import (builtin_dataset, drop_long_prompts, load_prompt_dataset,
                                parse_dataset_spec, read_rows, render_prompt, sample_indices)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = [
    {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
     "solution": "2"},
    {"prompt": "2+2?", "solution": "4", "target": 4},
    {"query": "3+3?", "solution": "6", "system": "Answer in digits."},
    {"prompt": [{"role": "system", "content": "Own system."}, {"role": "user", "content": "4+4?"}],
     "solution": "8"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_formats_give_the_same_rows(tmp_path):
    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    columnar = {"query": ["a?", "b?"], "solution": ["1", "2"]}
    (tmp_path / "cols.json").write_text(json.dumps(columnar))
    assert read_rows(jsonl) == ROWS
    assert read_rows(str(tmp_path / "list.json")) == ROWS
    assert read_rows(str(tmp_path / "cols.json")) == [{"query": "a?", "solution": "1"},
                                                      {"query": "b?", "solution": "2"}]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.Table.from_pylist([{"query": "a?", "solution": "1", "nums": [1, 2]},
                                  {"query": "b?", "solution": "2", "nums": [3]}])
    pq.write_table(table, str(tmp_path / "d.parquet"))
    ds = load_prompt_dataset([str(tmp_path / "d.parquet")])
    assert ds.messages == [[{"role": "user", "content": "a?"}], [{"role": "user", "content": "b?"}]]
    assert ds.columns == {"nums": [[1, 2], [3]], "solution": ["1", "2"]}


def test_prompt_column_variants_and_system(tmp_path):
    ds = load_prompt_dataset([write_jsonl(tmp_path / "d.jsonl", ROWS)], system="Default system.")
    assert ds.messages[0] == [{"role": "system", "content": "Default system."},
                              {"role": "user", "content": "1+1?"}]        # final assistant turn dropped
    assert ds.messages[1] == [{"role": "system", "content": "Default system."},
                              {"role": "user", "content": "2+2?"}]
    assert ds.messages[2][0] == {"role": "system", "content": "Answer in digits."}  # row's system wins
    assert ds.messages[3][0] == {"role": "system", "content": "Own system."}
    # Prompt columns are consumed; every other column is kept for the rewards (None where absent).
    assert ds.columns == {"solution": ["2", "4", "6", "8"], "target": [None, 4, None, None]}
    assert ds[1] == {"messages": ds.messages[1], "solution": "4", "target": 4}
    no_system = load_prompt_dataset([str(tmp_path / "d.jsonl")])
    assert no_system.messages[1] == [{"role": "user", "content": "2+2?"}]


def test_reward_columns_repeat_per_generation(tmp_path):
    ds = load_prompt_dataset([write_jsonl(tmp_path / "d.jsonl", ROWS)])
    cols = ds.reward_columns([2, 0], num_generations=3)
    assert cols["solution"] == ["6", "6", "6", "2", "2", "2"]
    assert cols["target"] == [None] * 6


def test_column_rename(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "5+5?", "answer": "10"}])
    ds = load_prompt_dataset([path], columns={"question": "query", "answer": "solution"})
    assert ds.messages == [[{"role": "user", "content": "5+5?"}]]
    assert ds.columns == {"solution": ["10"]}


def test_missing_prompt_column_names_file_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "5+5?", "answer": "10"}])
    with pytest.raises(ValueError) as e:
        load_prompt_dataset([path])
    msg = str(e.value)
    assert "bad.jsonl" in msg and "no prompt column" in msg
    assert "['messages', 'prompt', 'query']" in msg and "['answer', 'question']" in msg
    assert "--columns '{\"question\": \"query\"}'" in msg


@pytest.mark.parametrize("rows, pattern", [
    ([{"messages": [{"role": "bot", "content": "x"}]}], "each message must be"),
    ([{"messages": [{"role": "assistant", "content": "x"}]}], "no user turn"),
    ([{"prompt": 42}], "must be a string or a list of messages"),
    ([], "has no rows"),
])
def test_malformed_rows(tmp_path, rows, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_prompt_dataset([write_jsonl(tmp_path / "d.jsonl", rows)])


def test_file_errors(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"query": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"broken.jsonl' line 2 is not valid JSON"):
        read_rows(str(tmp_path / "broken.jsonl"))
    (tmp_path / "lines.json").write_text('{"query": "a"}\n{"query": "b"}\n')
    with pytest.raises(ValueError, match=r"should be named \.jsonl"):
        read_rows(str(tmp_path / "lines.json"))
    with pytest.raises(ValueError, match="file not found"):
        read_rows(str(tmp_path / "none.jsonl"))


def test_dataset_spec():
    assert parse_dataset_spec("a/b.jsonl") == ("a/b.jsonl", None)
    assert parse_dataset_spec("a/b.jsonl#100") == ("a/b.jsonl", 100)
    for bad in ["a.jsonl#0", "a.jsonl#x", "a.jsonl#"]:
        with pytest.raises(ValueError, match="#N suffix"):
            parse_dataset_spec(bad)


def test_hash_n_sampling(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": f"q{i}", "i": i} for i in range(10)])
    # Fewer rows than the file: distinct rows, seeded.
    a = load_prompt_dataset([f"{path}#4"], seed=1).columns["i"]
    assert len(a) == 4 and len(set(a)) == 4
    assert load_prompt_dataset([f"{path}#4"], seed=1).columns["i"] == a
    assert any(load_prompt_dataset([f"{path}#4"], seed=s).columns["i"] != a for s in range(2, 6))
    # More rows than the file: 2 full copies in file order, then 5 distinct drawn rows (ms-swift).
    b = load_prompt_dataset([f"{path}#25"], seed=3).columns["i"]
    assert b[:20] == list(range(10)) * 2
    assert len(set(b[20:])) == 5
    assert Counter(b)[b[20]] == 3
    # Exact multiple: only copies.
    assert sample_indices(10, 20, seed=0) == list(range(10)) * 2
    # Several files: concatenated in order, each sampled on its own.
    other = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "p", "j": 1}])
    ds = load_prompt_dataset([f"{path}#3", f"{other}#2"], seed=0)
    assert len(ds) == 5 and ds.columns["j"] == [None, None, None, 1, 1]
    assert ds.sources == [path] * 3 + [other] * 2


class _Tok:
    chat_template = None


def test_render_prompt_fallback_and_template():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_prompt(_Tok(), messages) == "system: S\nuser: U\nassistant: "

    class Templated:
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return "|".join(m["content"] for m in msgs) + "|>"
    assert render_prompt(Templated(), messages) == "S|U|>"


def test_drop_long_prompts_keeps_order_and_columns(tmp_path):
    rows = [{"query": "q" * n, "solution": str(n)} for n in (3, 9, 5, 12, 1)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_prompt_dataset([str(tmp_path / "d.jsonl")])
    length = lambda i: len(ds.messages[i][-1]["content"])    # noqa: E731 (its "tokens")
    kept, dropped = drop_long_prompts(ds, length, 5)
    assert dropped == 2 and len(kept) == 3
    assert [m[-1]["content"] for m in kept.messages] == ["qqq", "qqqqq", "q"]
    assert kept.columns["solution"] == ["3", "5", "1"]
    assert kept.reward_columns([1], 2) == {"solution": ["5", "5"]}
    with pytest.raises(ValueError, match=r"--max_length 0 .*delete.*shortest has 1 tokens"):
        drop_long_prompts(ds, length, 0)


def test_prompt_length_counts_an_image_prompt_with_its_image_tokens(tmp_path):
    """An image prompt's length is its encoded one (every image's tokens expanded), which
    --truncation_strategy delete compares with --max_length at start-up; a text prompt's
    is its rendered text's. A stand-in image processor expands each image to 50 tokens."""
    import types

    from megatron_grpo.data import prompt_length

    rows = [{"query": "a b", "images": ["x.png"]}, {"query": "a b c"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_prompt_dataset([str(tmp_path / "d.jsonl")])
    tok = lambda text, add_special_tokens: {"input_ids": text.split()}   # noqa: E731
    vision = types.SimpleNamespace(encode=lambda messages, images, base_dir: types.SimpleNamespace(
        prompt_ids=[0] * (2 + 50 * len(images))))
    length = prompt_length(ds, tok, lambda t, m: m[-1]["content"], vision)
    assert [length(0), length(1)] == [52, 3]
    kept, dropped = drop_long_prompts(ds, length, 10)
    assert dropped == 1 and kept.messages[0][-1]["content"] == "a b c"


def test_builtin_datasets_load():
    cd = load_prompt_dataset([builtin_dataset("countdown")])
    assert len(cd) == 400 and set(cd.columns) == {"nums", "target", "solution"}
    assert cd.messages[0][0]["role"] == "system" and "<answer>" in cd.messages[0][0]["content"]
    ar = load_prompt_dataset([builtin_dataset("arithmetic")])
    assert len(ar) == 200 and set(ar.columns) == {"solution"}
    # The shipped arithmetic answers are right (checked independently of the generator).
    for msg, sol in zip(ar.messages, ar.columns["solution"]):
        a, op, b = msg[-1]["content"][len("What is "):-1].split()
        assert int(sol) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    with pytest.raises(ValueError, match="available: \\['arithmetic', 'countdown'\\]"):
        builtin_dataset("gsm8k")


def test_generator_script_is_deterministic(tmp_path):
    out = tmp_path / "cd.jsonl"
    script = os.path.join(ROOT, "tools", "make_countdown_data.py")
    subprocess.run([sys.executable, script, "--task", "countdown", "--out", str(out)], check=True,
                   capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(builtin_dataset("countdown"), "rb") as shipped:
        assert out.read_bytes() == shipped.read()
