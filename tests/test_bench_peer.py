"""tools/bench_peer.py without TRL: arguments, the TRL config derived from ours, the
settings-differ list, the figures (medians, tokens/s, ratios), the memory sampler
(tools/pss.py) and the report of a side that fails. No test installs or runs TRL; the
TRL side's resolved config is stood in for by what trl_config asks for."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_grpo.config import parse_rlhf_args
from tools import bench_peer as bp
from tools import pss
from tools.make_tiny_model import _pseudo_word_corpus, _train_qwen_tokenizer, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", **bp.QUICKSTART_MODEL))


def resolved(shape, model_dir, *extra):
    cfg = parse_rlhf_args(bp.ours_argv(bp.SHAPES[shape], model_dir, "/tmp/unused", list(extra)))
    return cfg.to_flat(), cfg.grpo.steps_per_generation


# --------------------------------------------------------------------------- arguments
def test_parse_args_defaults_and_ours_args():
    a = bp.parse_args([])
    assert a.shapes == ["quickstart", "small"] and a.rounds == 1 and a.warmup == 1
    assert a.trl_venv == bp.DEFAULT_VENV and a.ours_args == [] and a.mem_interval == 0.25
    assert bp.parse_args(["--shapes", "real"]).shapes == ["real"]      # opt-in
    a = bp.parse_args(["--shapes", "small", "--rounds", "3",
                       "--ours-args=--tensor_model_parallel_size 1 --micro_batch_size 4"])
    assert a.shapes == ["small"] and a.rounds == 3
    assert a.ours_args == ["--tensor_model_parallel_size", "1", "--micro_batch_size", "4"]


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "quickstart,huge"], ["--shapes", "'huge'", "quickstart, small, real"]),
    (["--mem-interval", "0"], ["--mem-interval 0.0", "> 0"]),
    (["--rounds", "0"], ["--rounds 0", ">= 1"]),
    (["--warmup", "-1"], ["--warmup -1"]),
    (["--ours-args=--x 'unclosed"], ["--ours-args"]),
])
def test_parse_args_errors_name_the_option(argv, words, capsys):
    with pytest.raises(SystemExit):
        bp.parse_args(argv)
    err = capsys.readouterr().err
    for w in words:
        assert w in err


# --------------------------------------------------------------------------- TRL config
def test_trl_config_matches_the_quickstart(model_dir):
    flat, spg = resolved("quickstart", model_dir)
    c = bp.trl_config(flat, "/out")
    # 32 completions per step and per generation, micro-batches of 8: 4 accumulation steps.
    assert (c["per_device_train_batch_size"], c["gradient_accumulation_steps"],
            c["steps_per_generation"]) == (8, 4, 4)
    assert c["num_generations"] == 8 and c["max_completion_length"] == 24
    assert c["loss_type"] == "dapo" and c["beta"] == 0.0 and c["learning_rate"] == 3e-3
    assert c["lr_scheduler_type"] == "constant_with_warmup" and c["warmup_steps"] == 2
    assert c["top_k"] == 0                     # ours -1 (off) is TRL's 0 (off)
    assert c["epsilon_high"] == 0.2 and c["scale_rewards"] == "group"
    assert c["adam_beta2"] == 0.95             # ours, not torch's 0.999
    # bfloat16 as shipped (configs/quickstart_cpu.yaml); TRL's GRPOConfig default too
    assert c["bf16"] is True and c["gradient_checkpointing"] is False
    assert c["shuffle_dataset"] is False and c["max_steps"] == 30
    spec = bp.trl_spec(flat, spg, "/work", threads=2)
    assert spec["prompts_per_generation"] == 4 and spec["generation_batches"] == 31
    # --ours-args="--bf16 false": TRL follows to float32
    flat32, _ = resolved("quickstart", model_dir, "--bf16", "false")
    assert bp.trl_config(flat32, "/out")["bf16"] is False
    assert all(os.path.isabs(p) for p in spec["external_plugins"])


def test_trl_config_small_shape(model_dir):
    flat, _ = resolved("small", model_dir)
    c = bp.trl_config(flat, "/out")
    assert (c["per_device_train_batch_size"], c["gradient_accumulation_steps"],
            c["steps_per_generation"]) == (16, 8, 8)
    assert c["max_completion_length"] == 128 and c["max_steps"] == 6
    # Ours packs the micro-batches at this shape (what a user would pick); TRL cannot.
    assert flat["padding_free"] is True
    diff = dict(line.split(": ", 1) for line in bp.settings_differ(
        bp.ours_settings(flat, 2, 1), bp.trl_settings(c, threads=2)))
    assert diff["padding"].startswith("ours packed micro-batches (padding_free")
    # bfloat16 on both sides (TRL's GRPOConfig default): ours Megatron's, TRL's autocast.
    assert flat["bf16"] is True and c["bf16"] is True
    assert diff["dtype"] == "ours bfloat16 | trl bfloat16 autocast"


# --------------------------------------------------------------------------- settings
def _keys(lines):
    return [line.split(":")[0] for line in lines]


def test_settings_differ_lists_only_what_differs(model_dir):
    flat, spg = resolved("quickstart", model_dir)
    ours = bp.ours_settings(flat, 2, spg)
    trl = bp.trl_settings(bp.trl_config(flat, "/out"), threads=2)
    diff = bp.settings_differ(ours, trl)
    # The quickstart is DP=2: accumulation differs per rank (32 / (8 x DP 2) against 4).
    assert _keys(diff) == ["processes", "parallel layout", "generation", "weight sync",
                           "optimizer", "dtype", "accumulation", "completions_log"]
    assert "TP=1 PP=1 CP=1 DP=2" in diff[1]
    # both in bfloat16: Megatron's bf16 model against TRL's float32 model under autocast
    assert diff[5] == "dtype: ours bfloat16 | trl bfloat16 autocast"
    # Every mapped algorithm setting agrees, so a mapping slip in trl_config would show.
    for key in ("lr", "lr_schedule", "loss_type", "beta", "adam", "top_k",
                "checkpoints", "activation recompute"):
        assert ours[key] == trl[key], key


def test_settings_name_what_sizes_the_kv_cache(model_dir):
    """VLLM_CPU_KVCACHE_SPACE or kv_cache_memory_bytes replace the run's KV cache sizing
    (rollout/kv_cache.py, the same order); the generation setting says which one held."""
    flat, spg = resolved("quickstart", model_dir)

    def kv(flat, environ):
        return bp.ours_settings(flat, 2, spg, environ=environ)["generation"]

    assert "KV cache sized from the run" in kv(flat, {})
    assert "KV cache sized from the run" in kv(flat, {"VLLM_CPU_KVCACHE_SPACE": ""})
    assert "VLLM_CPU_KVCACHE_SPACE=1 GiB per engine" in kv(flat, {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert "--vllm_kv_cache_memory 64MiB" in kv(dict(flat, vllm_kv_cache_memory="64MiB"), {})
    engine = dict(flat, vllm_engine_kwargs={"kv_cache_memory_bytes": 1 << 26})
    assert "kv_cache_memory_bytes" in kv(engine, {"VLLM_CPU_KVCACHE_SPACE": "1"})


def test_settings_differ_shows_a_layout_and_a_setting_change(model_dir):
    flat, spg = resolved("quickstart", model_dir, "--tensor_model_parallel_size", "1")
    trl_args = dict(bp.trl_config(flat, "/out"), gradient_checkpointing=True, top_k=50)
    diff = bp.settings_differ(bp.ours_settings(flat, 2, spg), bp.trl_settings(trl_args, 1))
    lines = dict(line.split(": ", 1) for line in diff)
    assert lines["parallel layout"].startswith("ours TP=1 PP=1 CP=1 DP=2")
    assert lines["accumulation"] == "ours 2 | trl 4"       # per rank: 32 / (8 x DP 2)
    assert lines["activation recompute"] == "ours off | trl on"
    # Ours as resolved: the trainer's default (selective, core attention) is not "off".
    flat, spg = resolved("quickstart", model_dir, "--recompute_granularity", "selective")
    assert bp.ours_settings(flat, 2, spg)["activation recompute"] == "selective (core_attn)"
    assert lines["top_k"] == "ours off | trl 50"
    assert lines["processes"].endswith("trl 1 (1 torch threads)")
    # A setting one side lacks is listed as n/a.
    assert bp.settings_differ({"a": "1"}, {"b": "2"}) == ["a: ours 1 | trl n/a",
                                                         "b: ours n/a | trl 2"]


# --------------------------------------------------------------------------- figures
def _metrics(step, gen, train, sync, reward, length=20.0):
    return {"timing/step": step, "timing/generate": gen, "timing/score": 0.01,
            "timing/logprobs": 0.0, "timing/train": train, "timing/sync": sync,
            "reward": reward, "completions/mean_length": length}


def test_ours_rows_split_and_tokens():
    rows = bp.ours_rows([_metrics(1.0, 0.4, 0.3, 0.1, 0.5),
                         {"timing/step": 0.5, "timing/train": 0.4, "reward": 0.7}], 32)
    assert rows[0]["other"] == pytest.approx(1.0 - 0.4 - 0.01 - 0.3 - 0.1)
    assert rows[0]["tokens"] == 20.0 * 32
    assert rows[1]["tokens"] == 0.0 and rows[1]["generate"] == 0.0   # no generation that step


def test_trl_rows_split():
    rows = bp.trl_rows([{"step_s": 1.0, "generate_s": 0.5, "prepare_s": 0.6, "reward": 0.1,
                         "completions/mean_length": 10.0}], 32)
    r = rows[0]
    assert (r["generate"], r["score"], r["train"], r["sync"]) == pytest.approx((0.5, 0.1, 0.4, 0))
    assert r["tokens"] == 320.0


def test_summarize_medians_tokens_and_reward():
    steps = [9.0, 1.0, 2.0, 3.0, 4.0, 5.0]            # the first is the warm-up
    metrics = [_metrics(s, s / 2, s / 4, 0.1, reward=i / 10) for i, s in enumerate(steps)]
    run = bp.SideRun(bp.ours_rows(metrics, 32), wall_s=30.0, startup_s=7.0)
    s = bp.summarize(run, warmup=1)
    assert s["step_s"] == 3.0 and s["generate"] == 1.5 and s["steps"] == 6
    # tokens/s: 5 steps x 20 tokens x 32 completions over the generate seconds (7.5 s).
    assert s["gen_tokens_per_s"] == pytest.approx(5 * 640 / 7.5)
    k, first, last = s["reward"]
    assert k == 3 and first == pytest.approx(0.1) and last == pytest.approx(0.4)
    assert (s["wall_s"], s["startup_s"]) == (30.0, 7.0)


def test_ratios_take_medians_over_rounds_and_line_format():
    ours = [{"step_s": 1.0, "wall_s": 40.0, "gen_tokens_per_s": 1500.0},
            {"step_s": 3.0, "wall_s": 50.0, "gen_tokens_per_s": 1300.0},
            {"step_s": 2.0, "wall_s": 60.0, "gen_tokens_per_s": 1400.0}]
    trl = [{"step_s": 4.0, "wall_s": 25.0, "gen_tokens_per_s": 700.0}]
    for i, s in enumerate(ours):
        s["peak_pss_gib"] = 3.0 + i                   # median 4
    trl[0]["peak_pss_gib"] = 2.0
    r = bp.ratios(ours, trl)
    assert r.pop("completed") is True and r.pop("exits") == {}
    assert r == pytest.approx({"step_ratio": 0.5, "wall_ratio": 2.0,
                               "gen_tokens_per_s_ratio": 2.0, "mem_ratio": 2.0})
    assert bp.peer_line("quickstart", bp.ratios(ours, trl)) == (
        "peer_trl shape=quickstart step_ratio=0.500 wall_ratio=2.000 "
        "gen_tokens_per_s_ratio=2.000 mem_ratio=2.000 completed=true")
    r = bp.ratios(ours, [dict(trl[0], gen_tokens_per_s=math.nan)])
    assert math.isnan(r["gen_tokens_per_s_ratio"])


def test_two_optimizer_steps_per_generation(model_dir):
    flat, spg = resolved("quickstart", model_dir, "--generation_batch_size", "64")
    assert spg == 2
    c = bp.trl_config(flat, "/out")
    # 64 completions per generation in micro-batches of 8; 4 of them per optimizer step.
    assert (c["steps_per_generation"], c["gradient_accumulation_steps"]) == (8, 4)
    ours, trl = bp.ours_settings(flat, 2, spg), bp.trl_settings(c, threads=2)
    assert ours["steps_per_generation"] == trl["steps_per_generation"] == "2"
    assert "steps_per_generation" not in _keys(bp.settings_differ(ours, trl))
    assert bp.trl_spec(flat, spg, "/w", 2)["generation_batches"] == 16   # ceil(30 / 2) + 1


def test_profile_step_table_ranks_by_self_and_cumulative_time():
    import cProfile
    import pstats

    from tools.profile_step import cprofile_table

    def leaf():
        return sum(i * i for i in range(20000))

    def parent():
        return [leaf() for _ in range(3)]

    prof = cProfile.Profile()
    prof.runcall(parent)
    lines = cprofile_table(pstats.Stats(prof), top=3).splitlines()
    assert lines[0].endswith("(by self time)") and lines[4].endswith("(by cumulative time)")
    assert len(lines) == 8
    # The caller is among the top by cumulative time (its list comprehension and leaf can
    # nearly tie with it); paths are shortened to the repository's.
    assert any("parent (tests/test_bench_peer.py" in x for x in lines[5:8])
    assert any("genexpr" in x or "leaf" in x for x in lines[1:4])    # the work, by self time


def test_trl_venv_never_clears_a_folder_that_is_not_a_venv(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="--trl-venv .* not a virtual environment"):
        bp.ensure_trl_venv(str(tmp_path))
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_profile_step_wraps_the_names_the_loop_calls(monkeypatch):
    """tools/profile_step.py rebinds the loop's phase functions where the loop looks them
    up at call time; a rename in train/ must show here, not as a profile with no phases."""
    import megatron_grpo.train.rollout_step as R
    import megatron_grpo.train.run as Run
    import megatron_grpo.train.step as S
    from megatron_grpo.rollout.sync import WeightSync
    from tools import profile_step as ps

    targets = [(R, "collect_rollouts"), (R, "fill_logps"), (S, "train_micro_batches"),
               (S, "step_metrics"), (Run, "build_policy"), (WeightSync, "__call__")]
    for owner, name in targets:
        monkeypatch.setattr(owner, name, getattr(owner, name))   # restored after the test
    before = {name: getattr(owner, name) for owner, name in targets}
    ps.install(ps.StepProfiler("/nonexistent", 1, "cprofile", 5, 0))
    assert [name for owner, name in targets if getattr(owner, name) is before[name]] == []


# --------------------------------------------------------------------------- the real shape
def test_real_shape_is_qwen25_05b_and_resolves_to_the_asked_work(model_dir):
    """Qwen2.5-0.5B-Instruct's architecture; 2 prompts x 4, 64 tokens, micro-batch 4, 3 steps,
    saved at step 3, bf16, the vowels reward; ours DP=2 with the distributed optimizer, and
    the TP=2 layout the docstring names. (The shape's flags resolved on the tiny model:
    building the 0.5B model takes ~30 s and ~3.5 GB.)"""
    m = bp.SHAPES["real"].model
    assert m == dict(family="qwen2", num_layers=24, hidden_size=896, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                     tie_word_embeddings=True, dtype="bfloat16", max_position_embeddings=32768,
                     rope_theta=1e6, tokenizer_vocab_size=151665, tokenizer_corpus_words=100_000)
    assert bp.parse_args([]).shapes == ["quickstart", "small"]       # not a default shape
    flat, spg = resolved("real", model_dir)
    assert (flat["generation_batch_size"], flat["num_generations"], flat["global_batch_size"],
            flat["micro_batch_size"], flat["max_completion_length"], flat["train_iters"],
            flat["save_steps"]) == (8, 4, 8, 4, 64, 3, 3)
    assert flat["bf16"] is True and spg == 1
    assert flat["reward_funcs"] == ["vowels"]
    assert flat["external_plugins"] == ["examples/plugins/vowels_reward.py"]
    c = bp.trl_config(flat, "/out")
    assert (c["per_device_train_batch_size"], c["gradient_accumulation_steps"],
            c["steps_per_generation"], c["num_generations"]) == (4, 2, 2, 4)
    assert (c["max_completion_length"], c["max_steps"], c["save_steps"], c["bf16"]) == \
        (64, 3, 3, True)
    spec = bp.trl_spec(flat, spg, "/w", 2)
    assert spec["prompts_per_generation"] == 2 and spec["reward_funcs"] == ["vowels"]
    assert spec["external_plugins"] == [os.path.join(bp.ROOT, "examples/plugins/vowels_reward.py")]
    ours = bp.ours_settings(flat, 2, spg)
    assert ours["parallel layout"] == "TP=1 PP=1 CP=1 DP=2, distributed optimizer"
    # TRL loads the bfloat16 checkpoint in float32 and trains under bf16 autocast: mixed
    # precision as ours (float32 main weights and Adam state), not bfloat16 throughout.
    assert c["model_init_kwargs"] == {"dtype": "float32"}
    assert bp.trl_settings(c, 2, model_dtype="bfloat16")["dtype"] == "bfloat16 autocast"
    assert bp.trl_settings(dict(c, model_init_kwargs={"dtype": "auto"}), 2,
                           model_dtype="bfloat16")["dtype"].startswith(
        "bfloat16 weights, grads and Adam state")

    from megatron_grpo.config import validate_world
    tp2 = ["--tensor_model_parallel_size", "2", "--use_distributed_optimizer", "false"]
    cfg = parse_rlhf_args(bp.ours_argv(bp.SHAPES["real"], model_dir, "/tmp/unused", tp2))
    validate_world(cfg, 2)
    assert bp.ours_settings(cfg.to_flat(), 2, 1)["parallel layout"] == "TP=2 PP=1 CP=1 DP=1"
    # the docstring names the TP=2 run
    assert '--ours-args="--tensor_model_parallel_size 2 --use_distributed_optimizer false"' \
        in bp.__doc__


def test_vowels_reward_spreads_over_random_text_where_digits_is_zero():
    """What a random model over the 151k-token tokenizer writes: pseudo-words (samples
    seen: 'Stoondoothbraixiomceciendnytats...'), no digit. `digits` gives every completion
    0 (no advantage, nothing trains); `vowels` spreads within any group."""
    from megatron_grpo.rewards import REWARDS, load_plugins

    load_plugins([os.path.join(bp.ROOT, "examples/plugins/digits_reward.py"),
                  os.path.join(bp.ROOT, "examples/plugins/vowels_reward.py")])
    group = [" ".join(line.split()[:8]) for line in _pseudo_word_corpus(200, seed=3)
             if not any(ch.isdigit() for ch in line)][:4]
    assert len(group) == 4
    assert REWARDS["digits"](group) == [0.0] * 4
    scores = REWARDS["vowels"](group)
    assert len(set(scores)) > 1 and all(0 < x < 1 for x in scores)
    assert REWARDS["vowels"](["", "aXe1"]) == [0.0, 0.5]


def test_tokenizer_corpus_words_grows_the_bpe_and_llama_refuses_it(tmp_path):
    """make_tiny_model's full-size tokenizer option: distinct pseudo-words give the BPE
    merges (the built-in corpus stops below 900 tokens); 0 is the default corpus."""
    words = " ".join(_pseudo_word_corpus(3000)).split()
    assert _pseudo_word_corpus(3000) == _pseudo_word_corpus(3000)        # deterministic
    assert len({w.lower().strip(".,?!;:") for w in words if w.isalpha() or
                w[:-1].isalpha()}) >= 2900
    assert _train_qwen_tokenizer(151665).get_vocab_size() <= 900
    assert _train_qwen_tokenizer(151665, (), 3000).get_vocab_size() > 10_000
    with pytest.raises(ValueError, match="tokenizer_corpus_words=5 is for the byte-level BPE"):
        make_tiny_model(tmp_path / "llama", family="llama", tokenizer_corpus_words=5)
    with pytest.raises(ValueError, match="tokenizer_corpus_words=-1 must be >= 0"):
        make_tiny_model(tmp_path / "q", tokenizer_corpus_words=-1)


# --------------------------------------------------------------------------- memory (PSS)
def _fork_holding(mib: int):
    """A forked child that writes `mib` MiB, says so on a pipe and sleeps until killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                      # the child: no pytest code past here
        try:
            os.close(r)
            held = b"x" * (mib << 20)                 # written, so resident
            os.write(w, b"1")
            time.sleep(60)
            del held
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    return pid


def test_pss_tree_sums_this_process_and_a_forked_child():
    me = os.getpid()
    alone = pss.read_memory(me)
    assert alone is not None and 0 < alone[0] <= alone[1]            # PSS <= RSS
    pid = _fork_holding(64)
    try:
        assert pid in pss.children(me)
        tree = {m.pid: m for m in pss.tree_memory(me)}
        assert tree[me].depth == 0 and tree[pid].depth == 1
        # the child's 64 MiB are its own (PSS = RSS for them); what it shares with this
        # process after the fork counts half in each, so the sum is not inflated
        assert tree[pid].pss_kb >= 60 << 10
        total = pss.tree_pss_kb(me)
        assert total >= tree[me].pss_kb + (60 << 10)
        assert total < sum(m.rss_kb for m in tree.values())
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert pss.read_memory(pid) is None and pid not in pss.children(me)
    assert pss.read_memory(2 ** 22 + 12345) is None                   # no such process


def test_peak_sampler_keeps_the_largest_sample_and_its_processes():
    code = "import time; b = b'x' * (96 << 20); time.sleep(0.8); del b; time.sleep(0.4)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    with pss.PeakSampler(proc.pid, interval=0.05) as sampler:
        proc.wait()
    peak = sampler.peak
    assert peak.samples >= 5 and peak.gib >= 90 / 1024
    assert [m.pid for m in peak.processes] == [proc.pid]
    assert peak.processes[0].rss_kb >= peak.processes[0].pss_kb
    lines = pss.format_peak(peak)
    assert lines[0].split()[:2] == ["pid", str(proc.pid)] and "PSS" in lines[0]
    with pytest.raises(ValueError, match="interval=0 must be > 0"):
        pss.PeakSampler(1, interval=0)


def test_pss_cli_prints_the_peak_and_passes_the_exit_code(capsys):
    assert pss.main(["--interval", "0.05", "--", sys.executable, "-c",
                     "import sys, time; b = b'x' * (32 << 20); time.sleep(0.3); sys.exit(3)"]) == 3
    out = capsys.readouterr().out
    assert out.startswith("pss peak_gib=") and " exit=3" in out.splitlines()[0]
    assert float(out.split("peak_gib=")[1].split()[0]) >= 30 / 1024
    assert pss.main([sys.executable]) == 2                             # no `--`
    assert "CMD after `--`" in capsys.readouterr().err


# --------------------------------------------------------------------------- a side that fails
def test_a_failed_side_is_reported_not_raised():
    """Exit 137 (a rank killed by the OOM killer; our launcher exits 128 + 9): the side's
    line says FAILED with the code and the peak PSS it reached, the timings left out of the
    ratios, its peak kept in mem_ratio, and the last line says completed=false."""
    peak = pss.Peak(pss_kb=int(14.5 * 2**20), samples=40)
    rows = bp.ours_rows([_metrics(9.0, 4.0, 3.0, 1.0, 0.3)], 8)       # one step, then killed
    s = bp.summarize(bp.SideRun(rows, wall_s=80.0, startup_s=50.0, rc=137, peak=peak), warmup=1)
    assert s["completed"] is False and s["steps"] == 1 and s["peak_pss_gib"] == 14.5
    line = bp.format_summary("ours", 1, s)
    assert "FAILED (exit 137, killed by SIGKILL: what the kernel's OOM killer sends" in line
    assert "after 1 logged step(s), peak PSS 14.50 GiB reached" in line
    # died before its first step: no step figures, still a line
    s0 = bp.summarize(bp.SideRun([], wall_s=30.0, startup_s=math.nan, rc=-9, peak=peak), 1)
    assert math.isnan(s0["step_s"]) and math.isnan(s0["generate"])
    assert "FAILED (exit -9, killed by SIGKILL" in bp.format_summary("ours", 1, s0)
    trl = bp.summarize(bp.SideRun(bp.trl_rows([{"step_s": 2.0, "generate_s": 1.0,
                                                "prepare_s": 1.2}] * 3, 8), 60.0, 20.0,
                                  peak=pss.Peak(pss_kb=5 * 2**20)), 1)
    r = bp.ratios([s], [trl])
    assert r["completed"] is False and r["exits"] == {"ours_exit": 137}
    assert math.isnan(r["step_ratio"]) and math.isnan(r["wall_ratio"])
    assert r["mem_ratio"] == pytest.approx(14.5 / 5)
    assert bp.peer_line("real", r) == (
        "peer_trl shape=real step_ratio=nan wall_ratio=nan gen_tokens_per_s_ratio=nan "
        "mem_ratio=2.900 completed=false ours_exit=137")
    assert bp.describe_exit(1) == "exit 1" and bp.describe_exit(0) == "exit 0"
    assert bp.describe_exit(143) == "exit 143, killed by SIGTERM"


def test_run_ours_reports_a_failing_run(model_dir, tmp_path, capsys):
    """A real `megatron rlhf` that exits non-zero (here at once: an unknown flag): no
    SystemExit, the exit code, the log's end, the peak PSS, no final_hf/."""
    run = bp.run_ours(bp.SHAPES["quickstart"], model_dir, str(tmp_path), ["--no_such_flag", "1"],
                      2, 32, mem_interval=0.05)
    assert run.rc == 2 and run.rows == [] and math.isnan(run.startup_s)
    assert run.saved == "final_hf/ not written"
    assert run.peak is not None and run.peak.samples >= 1
    out = capsys.readouterr().out
    assert "ours: FAILED (exit 2)" in out and "unknown option --no_such_flag" in out
    s = bp.summarize(run, 1)
    assert not s["completed"] and "FAILED (exit 2)" in bp.side_lines("ours", 1, s)[0]


def test_saves_and_metrics_read_back(tmp_path):
    final = tmp_path / "ours" / "final_hf"
    assert bp.hf_folder_state(str(final)) == "final_hf/ not written"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    assert bp.hf_folder_state(str(final)) == "final_hf/ incomplete (no *.safetensors)"
    (final / "model.safetensors").write_bytes(b"\0" * 1024)
    assert bp.hf_folder_state(str(final)).startswith(
        "final_hf/ written (config.json, 1 safetensors file(s)")
    trl = tmp_path / "trl"
    assert bp.trl_saves(str(trl)) == "final/ not written; checkpoints: none"
    for step in (10, 3):
        (trl / f"checkpoint-{step}").mkdir(parents=True)
    assert bp.trl_saves(str(trl)).endswith("checkpoints: checkpoint-3, checkpoint-10")
    # a metrics file whose last line was cut short by a kill
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"timing/step": 1.0}) + "\n" + '{"timing/st')
    assert bp.read_jsonl(str(path)) == [{"timing/step": 1.0}]
    assert bp.read_jsonl(str(tmp_path / "none.jsonl")) == []
