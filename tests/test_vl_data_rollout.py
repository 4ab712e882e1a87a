"""Vision-language data and rollouts: ms-swift's multimodal rows -> the model's
processor -> vLLM, in colocate mode (ColocateEngine) and server mode (`megatron rollout`
+ RolloutClient), on the tiny Qwen2.5-VL of tools/make_tiny_vl_model.py and the
counting task of tools/make_vl_count_data.py.

References are independent of vLLM: the HF processor's expanded prompt ids, and HF
transformers' per-token log-probs in float32 (tolerance 1e-5, as
tests/test_vl_tiny_model.py). The pixel budget of the vLLM tests (MAX_PIXELS below the
model's own) changes the image token count, so a budget that did not reach vLLM's
processor fails the prompt-id comparison.
"""
from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest
import torch

from megatron_grpo.data import load_prompt_dataset
from megatron_grpo.data.vision import VisionProcessor, png_base64, resolve_max_pixels
from tests.harness import rollout_server, run_distributed
from tests.mcore_utils import lora_model, randomize_lora_b
from tests.test_vl_tiny_model import ATOL, TEMPERATURE, hf_logits, needs_vllm
from tools.make_tiny_vl_model import make_tiny_vl_model
from tools.make_vl_count_data import main as make_count_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 6x4 patches at most (6 image tokens): below the tiny model's 12544 (16 tokens), and the
# count task's 112x84 images (12 tokens at the model's budget) are resized down to it.
BUDGET = 28 * 28 * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_data(["--out_dir", str(tmp_path_factory.mktemp("count")), "--n", "4",
                            "--distractors"])


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def red_blobs(path) -> int:
    """Connected red regions of an image (4-neighbour flood fill): the count, independently."""
    from PIL import Image

    a = np.asarray(Image.open(path).convert("RGB")).astype(int)
    red = (a[..., 0] > 200) & (a[..., 1] < 50) & (a[..., 2] < 50)
    seen, blobs = np.zeros_like(red), 0
    for y, x in zip(*np.nonzero(red)):
        if seen[y, x]:
            continue
        blobs += 1
        stack = [(y, x)]
        while stack:
            i, j = stack.pop()
            if 0 <= i < red.shape[0] and 0 <= j < red.shape[1] and red[i, j] and not seen[i, j]:
                seen[i, j] = True
                stack += [(i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)]
    return blobs


def test_count_data_rows_load_with_their_answers(count_data, tmp_path):
    rows = [json.loads(line) for line in open(count_data)]
    base = os.path.dirname(count_data)
    for row in rows:
        assert red_blobs(os.path.join(base, row["images"][0])) == int(row["solution"])
    assert make_count_data(["--out_dir", str(tmp_path), "--n", "4", "--distractors"])
    for name in ("train.jsonl", "images/0003.png"):    # same arguments, same bytes
        assert (tmp_path / name).read_bytes() == open(os.path.join(base, name), "rb").read()

    # ms-swift's format through load_prompt_dataset: images kept apart from the reward
    # columns, tags checked per row, a missing tag added at the start of the first user turn.
    png = open(os.path.join(base, rows[0]["images"][0]), "rb").read()
    extra = tmp_path / "more.jsonl"
    extra.write_text(json.dumps({"query": "What is this?", "images": [
        "data:image/png;base64," + base64.b64encode(png).decode()], "solution": "1"}) + "\n")
    ds = load_prompt_dataset([count_data, str(extra)])
    assert len(ds) == 5 and ds.images[0] == rows[0]["images"] and "images" not in ds.columns
    assert ds.messages[4][-1]["content"] == "<image>What is this?"
    assert ds.subset([4, 0]).images == [ds.images[4], ds.images[0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "<image><image>Compare", "images": ["a.png"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl' row 0: its messages hold 2 <image> tags "
                                         r"but its `images` column 1 image"):
        load_prompt_dataset([str(bad)])


def test_colour_data_rows_are_balanced_and_drawn_as_answered(tmp_path):
    """tools/make_vl_colour_data.py (the learning task of tests/test_vl_e2e.py): the
    square's colour, read from the pixels, is the row's answer; rows alternate colours
    (every even-sized window of consecutive rows is balanced); --blank draws white."""
    from tools.make_vl_colour_data import COLOURS
    from tools.make_vl_colour_data import main as make_colour_data
    from PIL import Image

    out = make_colour_data(["--out_dir", str(tmp_path / "a"), "--n", "6", "--n_val", "2",
                            "--colours", "3"])
    for split, n in (("train", 6), ("val", 2)):
        rows = [json.loads(line) for line in open(out[split])]
        assert [r["solution"] for r in rows] == [str(i % 3 + 1) for i in range(n)]
        for r in rows:
            a = np.asarray(Image.open(tmp_path / "a" / r["images"][0]).convert("RGB")).reshape(-1, 3)
            ink = a[(a != 255).any(axis=1)]
            assert len(ink) >= 48 * 48, r      # one square of side 48-64 px
            want = COLOURS[int(r["solution"]) - 1][1]
            assert (ink == want).all(axis=1).all(), (r, np.unique(ink, axis=0)[:3])
    assert "model" not in out
    blank = make_colour_data(["--out_dir", str(tmp_path / "b"), "--n", "2", "--n_val", "0",
                              "--blank"])
    for r in (json.loads(line) for line in open(blank["train"])):
        assert (np.asarray(Image.open(tmp_path / "b" / r["images"][0])) == 255).all()
    again = make_colour_data(["--out_dir", str(tmp_path / "c"), "--n", "6", "--n_val", "2",
                              "--colours", "3"])
    for name in ("train.jsonl", "images/train_0005.png"):    # same arguments, same bytes
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    assert again["val"].endswith("val.jsonl")
    with pytest.raises(ValueError, match="--colours 4: allowed 2..3"):
        make_colour_data(["--out_dir", str(tmp_path / "d"), "--colours", "4"])


def test_processor_encodes_prompts_for_trainer_and_vllm(model_dir, count_data, monkeypatch):
    ds = load_prompt_dataset([count_data])
    base = os.path.dirname(count_data)
    vp = VisionProcessor(str(model_dir))
    p = vp.encode(ds.messages[0], ds.images[0], base_dir=base)
    assert vp.mm_processor_kwargs == {} and p.image_grid_thw.tolist() == [[1, 6, 8]]
    pad = vp.image_token_id
    # The trainer's ids: 12 pads (6x8 patches / 2x2 merge); vLLM's: one, the rest equal.
    assert p.prompt_ids.count(pad) == 12 and p.vllm_prompt_ids.count(pad) == 1
    first = p.prompt_ids.index(pad)
    assert p.prompt_ids[:first + 1] + p.prompt_ids[first + 12:] == p.vllm_prompt_ids
    assert p.mm_token_type_ids == [int(t == pad) for t in p.prompt_ids]
    assert tuple(p.pixel_values.shape) == (48, 3 * 2 * 14 * 14)

    # ms-swift's MAX_PIXELS reaches the processor; --max_pixels wins over it.
    monkeypatch.setenv("MAX_PIXELS", str(BUDGET))
    small = VisionProcessor(str(model_dir)).encode(ds.messages[0], ds.images[0], base_dir=base)
    assert small.prompt_ids.count(pad) * 4 * 14 * 14 <= BUDGET < p.prompt_ids.count(pad) * 784
    assert VisionProcessor(str(model_dir), max_pixels=12544).mm_processor_kwargs == \
        {"max_pixels": 12544}
    with pytest.raises(ValueError, match=r"MAX_PIXELS \(environment\)='lots' is not an integer"):
        resolve_max_pixels(None, environ={"MAX_PIXELS": "lots"})
    with pytest.raises(ValueError, match=r"--max_pixels=100 is below the model's min_pixels=3136"):
        resolve_max_pixels(100, str(model_dir))
    with pytest.raises(RuntimeError, match="vLLM expanded an image prompt to 3 tokens"):
        p.check_expanded([1, 2, 3])


def test_vision_options_are_checked_before_start_up(model_dir, count_data, monkeypatch,
                                                     tmp_path):
    """--max_pixels / MAX_PIXELS and --vllm_limit_mm_per_prompt (ms-swift's flags), for
    `megatron rlhf` and `megatron rollout`: one line naming the option and what is allowed."""
    from megatron_grpo.config import build_config
    from megatron_grpo.config.rollout_server import parse_rollout_args
    from megatron_grpo.rollout.server import vllm_cli_args

    monkeypatch.delenv("MAX_PIXELS", raising=False)
    base = ["--model", str(model_dir), "--dataset", count_data, "--reward_funcs", "accuracy"]
    cfg, problems = build_config(base + ["--max_pixels", "4704",
                                         "--vllm_limit_mm_per_prompt", '{"image": 2}'])
    assert not problems.messages, problems.messages
    assert (cfg.data.max_pixels, cfg.rollout.vllm_limit_mm_per_prompt) == (4704, {"image": 2})
    _, problems = build_config(base + ["--max_pixels", "100",
                                       "--vllm_limit_mm_per_prompt", '{"video": 1}'])
    text = "\n".join(problems.messages)
    assert "--max_pixels=100 is below the model's min_pixels=3136" in text
    assert "--vllm_limit_mm_per_prompt {'video': 1} is not valid" in text and \
        "allowed modalities: image" in text
    # --tuner_type lora_llm (the tower trained beside the adapters) fits a VL model.
    _, problems = build_config(base + ["--tuner_type", "lora_llm"])
    assert not problems.messages, problems.messages
    # --tuner_type lora --freeze_vit false: adapters on the tower's linears (all-linear only;
    # the language model keeps its adapters).
    tower = base + ["--tuner_type", "lora", "--freeze_vit", "false", "--freeze_aligner", "false"]
    for extra in ([], ["--vllm_enable_lora", "true"]):
        _, problems = build_config(tower + extra)
        assert not problems.messages, problems.messages
    for extra, part in ((["--target_modules", "q_proj"], "Fix: --target_modules all-linear"),
                        (["--freeze_llm", "true"], "alone (none on the language model)")):
        _, problems = build_config(tower + extra)
        assert len(problems.messages) == 1 and part in problems.messages[0], problems.messages
    # --adapters with tower adapters (the regex model/lora_peft.py writes) needs the flags
    from megatron_grpo.model.lora_peft import _vl_targets_regex

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
         "target_modules": _vl_targets_regex(["q_proj"], ("blocks.0.attn.qkv",))}))
    _, problems = build_config(tower + ["--adapters", str(adapter), "--freeze_aligner", "true"])
    assert not problems.messages, problems.messages
    _, problems = build_config(tower + ["--adapters", str(adapter)])
    assert len(problems.messages) == 1 and "on the merger: false" in problems.messages[0] and \
        "Fix: --freeze_vit false --freeze_aligner true" in problems.messages[0]
    _, problems = build_config(base + ["--check_weight_sync", "true"])
    assert not problems.messages, problems.messages
    monkeypatch.setenv("MAX_PIXELS", "many")
    _, problems = build_config(base)
    assert "MAX_PIXELS (environment)='many' is not an integer" in "\n".join(problems.messages)
    monkeypatch.setenv("MAX_PIXELS", "4704")     # the server takes it too, as vLLM flags
    argv = vllm_cli_args(parse_rollout_args(["--model", str(model_dir),
                                             "--vllm_limit_mm_per_prompt", '{"image": 1}']),
                         on_cpu=True)
    assert json.loads(argv[argv.index("--mm-processor-kwargs") + 1]) == {"max_pixels": 4704}
    assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 1}


def hf_completion_logits(hf_model, prompt, completion):
    """HF's logits [T, V] over prompt + completion, the completion read as text.

    Built from embeddings: the random tiny model does sample `<|image_pad|>`, and HF's
    forward would take such a completion token for an image slot ("Image features and
    image tokens do not match"); vLLM embeds sampled tokens as text. So: the word
    embeddings, the vision tower's output at the prompt's image tokens
    (mm_token_type_ids), and get_rope_index's positions, as HF's forward builds them."""
    m = hf_model.model
    ids = torch.tensor(prompt.prompt_ids + list(completion))[None]
    types = torch.tensor(prompt.mm_token_type_ids + [0] * len(completion))[None]
    with torch.no_grad():
        emb = m.get_input_embeddings()(ids)
        feats = m.get_image_features(prompt.pixel_values, prompt.image_grid_thw).pooler_output
        feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        emb[types.bool()] = feats.to(emb.dtype)
        pos, _ = m.get_rope_index(ids, types, prompt.image_grid_thw)
        return hf_model(inputs_embeds=emb, position_ids=pos, use_cache=False).logits[0].double()


def test_completion_reference_equals_hf_forward(model_dir, count_data, hf_model):
    """The embeddings-built reference is HF's own forward where both apply."""
    ds = load_prompt_dataset([count_data])
    p = VisionProcessor(str(model_dir)).encode(ds.messages[0], ds.images[0],
                                               base_dir=os.path.dirname(count_data))
    enc = {"input_ids": torch.tensor(p.prompt_ids)[None], "pixel_values": p.pixel_values,
           "mm_token_type_ids": torch.tensor(p.mm_token_type_ids)[None],
           "image_grid_thw": p.image_grid_thw}
    completion = [374, 12, 187]
    assert torch.equal(hf_completion_logits(hf_model, p, completion),
                       hf_logits(hf_model, enc, completion))


def _reference_check(hf_model, prompt, completions, where):
    """Prompt ids as vLLM expanded them == the processor's; log-probs == HF fp32."""
    n = len(prompt.prompt_ids)
    for c in completions:
        prompt.check_expanded(c["prompt_token_ids"])
        assert 1 <= len(c["token_ids"]) <= 4
        logits = hf_completion_logits(hf_model, prompt, c["token_ids"])
        logp = torch.log_softmax(logits / TEMPERATURE, -1)
        ref = logp[torch.arange(n - 1, n - 1 + len(c["token_ids"])), torch.tensor(c["token_ids"])]
        diff = max(abs(a - b) for a, b in zip(c["logprobs"], ref.tolist()))
        assert diff < ATOL, (where, diff, c)


def _encode_all(model_dir, count_data, max_pixels):
    ds = load_prompt_dataset([count_data])
    vp = VisionProcessor(str(model_dir), max_pixels=max_pixels)
    base = os.path.dirname(count_data)
    return vp, [vp.encode(ds.messages[i], ds.images[i], base_dir=base) for i in range(2)]


def _colocate_rank(rank, world_size, model_dir, count_data, export_root):
    """The engine starts from a `megatron export` of the model (HF -> Megatron -> HF), so
    vLLM loading the export costs no engine start of its own."""
    import contextlib

    from megatron_grpo.convert import main as convert
    from megatron_grpo.rollout.colocate import ColocateEngine

    mcore, exported = os.path.join(export_root, "mcore"), os.path.join(export_root, "hf")
    with contextlib.redirect_stdout(io.StringIO()):
        convert(["--to_mcore", "true", "--model", model_dir, "--output_dir", mcore])
        convert(["--to_hf", "true", "--mcore_model", mcore, "--output_dir", exported])
    source, model_dir = model_dir, exported
    # The budget by the environment, as an ms-swift script sets it (train.setup passes
    # VisionProcessor.mm_processor_kwargs to the engine the same way).
    os.environ["MAX_PIXELS"] = str(BUDGET)
    try:
        vp, prompts = _encode_all(model_dir, count_data, None)
    finally:
        del os.environ["MAX_PIXELS"]
    engine = ColocateEngine(model_dir, dtype="float32", seed=0, vllm_enforce_eager=True,
                            vllm_max_model_len=256, vllm_kv_cache_memory="32MiB",
                            temperature=TEMPERATURE, num_generations=2, max_completion_length=4,
                            vllm_limit_mm_per_prompt={"image": 1},
                            mm_processor_kwargs=vp.mm_processor_kwargs,
                            vllm_enable_lora=True, vllm_max_lora_rank=8)
    try:
        out = engine.generate([p.vllm_prompt_ids for p in prompts],
                              images=[p.images for p in prompts])
        text = engine.generate([prompts[0].vllm_prompt_ids[:3]])      # a text prompt too
        # --check_weight_sync's reading of a VL model: vLLM's tensors (its own names, the
        # tower's fused qkv and gate_up) are the checkpoint's, bit for bit.
        from safetensors.torch import load_file

        from bridge.mappings import get_mapping
        from megatron_grpo.rollout.verify import check_weight_sync, fingerprint_state

        checked = check_weight_sync(engine, fingerprint_state(load_file(os.path.join(
            source, "model.safetensors")).items()), get_mapping("qwen2_5_vl").vllm_aliases)
        lora = _adapter_only_sync(engine, source, export_root)
        lora["out"] = [c.__dict__ for c in engine.generate([p.vllm_prompt_ids for p in prompts],
                                                           images=[p.images for p in prompts])]
    finally:
        engine.close()
    return [c.__dict__ for c in out], [c.__dict__ for c in text], checked, lora


def _adapter_only_sync(engine, model_dir, root):
    """--vllm_enable_lora on the VL model: LoRA (random B) on a Megatron copy, on the
    language model and (--tuner_type lora --freeze_vit/--freeze_aligner false) on every
    tower and merger linear; the trainer's WeightSync with --check_weight_sync sends the
    language model's adapter alone (vLLM's names read back by the family's aliases) and
    the tower merged into vLLM's tower weights (fingerprinted); the PEFT adapter written
    for the HF reference."""
    import types

    from megatron_grpo.model import build_transformer_config
    from megatron_grpo.model.lora import LoraSettings, lora_settings
    from megatron_grpo.model.lora_peft import gather_adapters, save_peft_adapter
    from megatron_grpo.rollout.sync import WeightSync

    config, args = build_transformer_config(model_dir)      # the export's world: TP=1
    chunks = lora_model(config, args, model_dir, LoraSettings(rank=4, alpha=8, dropout=0.0,
                                                               tower=True, aligner=True))
    randomize_lora_b(chunks, torch.Generator().manual_seed(7))
    save_peft_adapter(os.path.join(root, "adapter"), gather_adapters(chunks),
                      lora_settings(chunks), base_model=model_dir)
    opts = types.SimpleNamespace(vllm_mode="colocate", sleep_level=0, move_model_batches=None,
                                 offload_bridge=False, check_weight_sync=True,
                                 vllm_enable_lora=True, offload_model=False,
                                 offload_optimizer=False)
    policy = types.SimpleNamespace(chunks=chunks, config=config, args=args, optimizer=None)
    return {"info": WeightSync(policy, engine, opts)()}


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_colocate_engine_samples_dataset_images_with_hf_logprobs(model_dir, count_data, hf_model,
                                                                tmp_path):
    """vLLM runs a `megatron export`ed copy of the model: the export holds every file vLLM
    and the processor read (preprocessor_config.json, chat template, tokenizer, generation
    config) and the original weights bit for bit, and vLLM's log-probs on it are HF's on
    the original."""
    from safetensors.torch import load_file

    out, text, checked, lora = run_distributed(
        _colocate_rank, world_size=1, timeout=400,
        args=(str(model_dir), count_data, str(tmp_path)))[0]
    exported = tmp_path / "hf"
    side = {f.name for f in model_dir.iterdir() if not f.name.endswith(".safetensors")}
    assert {"preprocessor_config.json", "chat_template.jinja", "tokenizer.json",
            "generation_config.json"} <= side
    for name in side:
        assert (exported / name).read_bytes() == (model_dir / name).read_bytes(), name
    weights = {}
    for f in exported.glob("*.safetensors"):
        weights.update(load_file(f))
    original = load_file(model_dir / "model.safetensors")
    assert sorted(weights) == sorted(original)
    assert all(torch.equal(weights[n], t) and weights[n].dtype == t.dtype
               for n, t in original.items())
    assert checked == len(original)      # every tensor, the tower's included, found in vLLM

    # --vllm_enable_lora: the same engine samples with the adapter synced alone (2 layers
    # x 7 targets x A, B; fingerprint-checked) and the tower's adapters merged into its
    # tower; its log-probs are HF + PEFT's (merged, tower included).
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    assert lora["info"]["tensors"] == 28 and lora["info"]["lora_name"] == "mgrpo-lora-1"
    merged = PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32), tmp_path / "adapter").merge_and_unload().eval()
    _, prompts = _encode_all(model_dir, count_data, BUDGET)
    for i, prompt in enumerate(prompts):
        mine = [c for c in lora["out"] if c["prompt_index"] == i]
        _reference_check(merged, prompt, mine, ("lora", i))
        with pytest.raises(AssertionError):        # the adapter matters: not the base's
            _reference_check(hf_model, prompt, mine, ("base", i))
    _, prompts = _encode_all(model_dir, count_data, BUDGET)
    assert [c["prompt_index"] for c in out] == [0, 0, 1, 1]
    for i, prompt in enumerate(prompts):
        assert prompt.image_grid_thw.prod().item() * 14 * 14 <= BUDGET     # the budget applied
        _reference_check(hf_model, prompt, [c for c in out if c["prompt_index"] == i], i)
    assert all(c["prompt_token_ids"] is None for c in text)


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_rollout_server_samples_images_with_hf_logprobs(model_dir, count_data, hf_model,
                                                        tmp_path):
    """`megatron rollout` on the tiny Qwen2.5-VL (the patches applied in the server and
    its forked engine process), --max_pixels and --vllm_limit_mm_per_prompt given as
    flags; RolloutClient sends the images as PNG.

    Then, on the same server, 2 GRPO steps of `megatron rlhf --vllm_mode server` (TP=2,
    fp32, beta 0.04, --tuner_type lora_llm: LoRA on the language model, the tower and
    merger trained in full, --check_weight_sync true): the trainer's log-probs of what the
    server sampled equal the server's (rollout_correction/* < 1e-4) at step 1 and at step
    2, which samples from the weights step 1 streamed to the server (the merged language
    model and the trained tower, fingerprinted in vLLM by name; its KL to the reference,
    the adapters off, is not 0; the server resets vLLM's encoder cache with them); the
    final PEFT adapter carries the trained tower (modules_to_save `visual`)."""
    from megatron_grpo.rollout.client import RolloutClient
    from tests.test_trainer_e2e import _argv, _metrics, _run

    with rollout_server(model_dir, tmp_path / "server.log", "--vllm_max_model_len", "256",
                        "--vllm_enforce_eager", "true", "--vllm_kv_cache_memory", "32MiB",
                        "--vllm_engine_kwargs", '{"dtype": "float32"}', "--max_pixels",
                        str(BUDGET), "--vllm_limit_mm_per_prompt", '{"image": 1}', "--seed", "0",
                        unset_env=("MAX_PIXELS",)) as server:
        client = RolloutClient(vllm_server_port=server.port, vllm_server_timeout=400,
                               temperature=TEMPERATURE, num_generations=2,
                               max_completion_length=4, seed=0)
        _, prompts = _encode_all(model_dir, count_data, BUDGET)
        out = client.generate([p.vllm_prompt_ids for p in prompts],
                              images=[p.images for p in prompts])
        run = str(tmp_path / "run")
        r = _run(_argv(str(model_dir), run, dataset=count_data,
                       reward_funcs=["accuracy", "digits"], tensor_model_parallel_size=2,
                       bf16="false", beta=0.04, lr=1e-2, max_pixels=BUDGET,
                       vllm_mode="server", vllm_server_host="127.0.0.1",
                       vllm_server_port=server.port, vllm_server_timeout=300,
                       log_rollout_offpolicy_metrics="true", vllm_max_model_len=256,
                       train_iters=2, tuner_type="lora_llm", check_weight_sync="true",
                       merge_lora="false",      # final_hf/: the adapter, checked below
                       # dropout 0: without old log-prob passes the trainer's side of
                       # rollout_correction is the training forward (adapter dropout on)
                       lora_dropout=0.0))
    assert [c.prompt_index for c in out] == [0, 0, 1, 1]
    for i, prompt in enumerate(prompts):
        _reference_check(hf_model, prompt, [c.__dict__ for c in out if c.prompt_index == i], i)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(run)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in ("kl", "log_ppl_diff_max", "log_ppl_diff_min"):
            assert abs(row["rollout_correction/" + key]) < 1e-4, row
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] != 0.0, rows
    from safetensors.torch import load_file

    final = os.path.join(run, "final_hf")
    assert json.load(open(os.path.join(final, "adapter_config.json")))["modules_to_save"] == \
        ["visual"]
    adapter = load_file(os.path.join(final, "adapter_model.safetensors"))
    original = load_file(model_dir / "model.safetensors")
    tower = {k[len("base_model.model.model."):]: v for k, v in adapter.items()
             if k.startswith("base_model.model.model.visual.")}
    assert sorted(tower) == sorted(k for k in original if k.startswith("visual."))
    assert any(not torch.equal(t, original[k]) for k, t in tower.items())     # it trained
    # PNG is lossless: the server decodes the pixels the trainer processed.
    from PIL import Image

    again = Image.open(io.BytesIO(base64.b64decode(png_base64(prompts[0].images[0])[22:])))
    assert np.array_equal(np.asarray(again), np.asarray(prompts[0].images[0]))


def test_a_template_that_drops_the_image_is_refused_before_any_engine(model_dir, count_data,
                                                                      tmp_path):
    """A chat template that renders list-valued content as nothing leaves the prompt without
    its image placeholder: refused by the processor's check and by `megatron rlhf` (dry run
    and run alike) in one line naming the template, the row and the counts, before any
    model or engine (vLLM would fail inside generate, after the models loaded)."""
    import shutil
    import subprocess

    from tests import cli_zygote

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "chat_template.jinja").write_text(
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['content'] is string %}{{ m['content'] }}{%- endif %}<|im_end|>\n"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    ds = load_prompt_dataset([count_data])
    VisionProcessor(str(model_dir)).check_placeholders(ds)          # the model's own: fine
    with pytest.raises(ValueError) as e:
        VisionProcessor(str(broken)).check_placeholders(ds)
    assert f"the chat template of {broken} renders 0 image placeholder(s)" in str(e.value)
    assert "--dataset row 0, which has 1 image(s)" in str(e.value)
    argv = ["--model", str(broken), "--dataset", count_data, "--reward_funcs", "accuracy",
            "--output_dir", str(tmp_path / "out")]
    for extra in (["--dry_run", "true"], []):
        r = subprocess.run(cli_zygote.command("rlhf", *extra, *argv), cwd=ROOT,
                           env=cli_zygote.env(dict(os.environ, NPROC_PER_NODE="1")),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0
        assert "renders 0 image placeholder(s)" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
