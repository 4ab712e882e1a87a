"""tools/bench_peer.py without TRL: arguments, the TRL config derived from ours, the
settings-differ list, and the figures (medians, tokens/s, ratios). No test installs or
runs TRL; the TRL side's resolved config is stood in for by what trl_config asks for."""
import math
import os

import pytest

from megatron_grpo.config import parse_rlhf_args
from tools import bench_peer as bp
from tools.make_tiny_model import make_tiny_model


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
    assert a.trl_venv == bp.DEFAULT_VENV and a.ours_args == []
    a = bp.parse_args(["--shapes", "small", "--rounds", "3",
                       "--ours-args=--tensor_model_parallel_size 1 --micro_batch_size 4"])
    assert a.shapes == ["small"] and a.rounds == 3
    assert a.ours_args == ["--tensor_model_parallel_size", "1", "--micro_batch_size", "4"]


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "quickstart,huge"], ["--shapes", "'huge'", "quickstart, small"]),
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
    r = bp.ratios(ours, trl)
    assert r == pytest.approx({"step_ratio": 0.5, "wall_ratio": 2.0,
                               "gen_tokens_per_s_ratio": 2.0})
    assert bp.peer_line("quickstart", r) == ("peer_trl shape=quickstart step_ratio=0.500 "
                                             "wall_ratio=2.000 gen_tokens_per_s_ratio=2.000")
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
