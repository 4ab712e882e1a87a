"""Command-line and YAML parsing of the GRPO configuration."""
import json
import os
import typing

import pytest
import yaml

from megatron_grpo.config import GROUPS, ConfigError, GRPOConfig, parse_rlhf_args, rlhf_help
from megatron_grpo.config.groups import GRPOOptions
from megatron_grpo.config.parse import field_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "countdown.jsonl")
ARITH = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "arithmetic.jsonl")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(d)


def base(model_dir, *extra):
    return ["--model", model_dir, "--dataset", COUNTDOWN, "--reward_funcs", "countdown", *extra]


def test_defaults_follow_ms_swift(model_dir):
    cfg = parse_rlhf_args(base(model_dir))
    assert cfg.grpo.rlhf_type == "grpo"
    assert cfg.grpo.loss_type == "grpo"
    assert cfg.grpo.beta == 0.04
    assert cfg.grpo.epsilon == 0.2 and cfg.grpo.epsilon_high == 0.2   # None -> epsilon
    assert cfg.grpo.num_generations == 8
    assert cfg.grpo.max_completion_length == 512
    assert cfg.grpo.scale_rewards == "group" and cfg.grpo.kl_in_reward is False
    assert cfg.grpo.steps_per_generation == 1 and cfg.grpo.generation_batch_size == 16
    assert cfg.rollout.vllm_server_timeout == 240.0
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (0.9, 1.0, -1)
    assert cfg.training.tuner_type == "full"
    assert cfg.rollout.vllm_mode == "colocate" and cfg.rollout.vllm_enable_prefix_caching is True
    assert cfg.reward.cosine_max_len == 512 and cfg.reward.repetition_n_grams == 3
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (1, 16)
    assert cfg.training.lr == 1e-5 and cfg.training.weight_decay == 0.1 and cfg.training.seed == 42
    assert cfg.logging.output_dir == os.path.join("megatron_output", "tiny-model")


def test_lists_booleans_numbers(model_dir):
    cfg = parse_rlhf_args(base(model_dir) + [
        "--dataset", COUNTDOWN, f"{ARITH}#100",
        "--reward_funcs", "accuracy", "format",
        "--reward_weights", "1", "-0.5",           # a negative number is a value, not a flag
        "--use_vllm", "true", "--vllm_enforce_eager", "True", "--log_completions", "false",
        "--tensor_model_parallel_size", "2", "--epsilon", "0.1", "--sleep_level", "1",
        "--report_to", "--sequence_parallel",      # empty list; bare boolean flag = true
    ])
    assert cfg.data.dataset == [COUNTDOWN, f"{ARITH}#100"]
    assert cfg.reward.reward_funcs == ["accuracy", "format"]
    assert cfg.reward.reward_weights == [1.0, -0.5]
    assert cfg.rollout.use_vllm is True and cfg.rollout.vllm_enforce_eager is True
    assert cfg.logging.log_completions is False
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.grpo.epsilon == 0.1
    assert cfg.rollout.sleep_level == 1 and isinstance(cfg.rollout.sleep_level, int)
    assert cfg.logging.report_to == []


def test_equals_form_json_and_none(model_dir):
    cfg = parse_rlhf_args(base(model_dir) + [
        "--vllm_engine_kwargs", '{"max_num_batched_tokens": 4096}',
        "--columns={\"question\": \"query\"}", "--epsilon_high=0.28", "--train_iters", "none"])
    assert cfg.rollout.vllm_engine_kwargs == {"max_num_batched_tokens": 4096}
    assert cfg.data.columns == {"question": "query"}
    assert cfg.grpo.epsilon_high == 0.28
    assert cfg.training.train_iters is None


def test_dash_values_hyphen_spellings_and_repeats(model_dir):
    """What argparse alone would do otherwise: a value that starts with one dash is a value
    (argparse takes `-1e-05` for an option), `--a-b` is `--a_b`, the last repeat wins."""
    cfg = parse_rlhf_args(base(model_dir) + [
        "--reward_funcs", "countdown", "format", "--reward_weights", "1", "-1e-3", "--system", "-be brief", "--tensor-model-parallel-size",
        "2", "--learning-rate", "3e-6", "--seed", "1", "--seed=5"])
    assert cfg.reward.reward_weights == [1.0, -1e-3]
    assert cfg.data.system == "-be brief" and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.training.lr == 3e-6 and cfg.training.seed == 5
    with pytest.raises(ValueError, match=r"--lr -1e-05 must be > 0"):
        parse_rlhf_args(base(model_dir) + ["--lr", "-1e-5"])
    # Every problem at once: stray token, unknown flag (its value skipped), bad value, bad choice.
    with pytest.raises(ValueError) as e:
        parse_rlhf_args(["stray"] + base(model_dir) + ["--epsilonn", "0.1", "--use_vllm", "maybe",
                                                       "--loss_type", "foo"])
    assert len(e.value.messages) == 4, e.value.messages
    # `--` is reported and the flags after it still parse (argparse alone ends the options).
    from megatron_grpo.config import build_config

    cfg, problems = build_config(base(model_dir) + ["--", "--seed", "3"])
    assert problems.messages == ["unexpected argument '--': options are written --name value "
                                 "(e.g. --model /path/to/model)"] and cfg.training.seed == 3


def test_yaml_then_flags_override(model_dir, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": model_dir, "dataset": [COUNTDOWN], "reward_funcs": ["countdown", "format"],
        "num_generations": 4, "use_vllm": True, "vllm_mode": "colocate",
        "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},  # a group section
        "learning_rate": 3e-6,   # ms-swift's alias of lr
    }))
    cfg = parse_rlhf_args(["--num_generations", "8", "--config", str(path), "--seed", "7"])
    assert cfg.grpo.num_generations == 8          # the flag wins over the file, wherever --config is
    assert cfg.training.lr == 3e-6
    assert cfg.training.seed == 7
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.reward.reward_funcs == ["countdown", "format"]
    assert cfg.rollout.vllm_mode == "colocate"


def test_yaml_errors(tmp_path):
    with pytest.raises(ValueError, match="--config .*file not found"):
        parse_rlhf_args(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        parse_rlhf_args(["--config", str(bad)])
    twice = tmp_path / "twice.yaml"
    twice.write_text("lr: 1.0e-6\nlearning_rate: 2.0e-6\n")
    with pytest.raises(ValueError, match="sets lr twice"):
        parse_rlhf_args(["--config", str(twice)])
    typo = tmp_path / "typo.yaml"
    typo.write_text("num_generatons: 4\n")
    with pytest.raises(ValueError, match="unknown option --num_generatons.*--num_generations"):
        parse_rlhf_args(["--config", str(typo)])


def test_aliases(model_dir):
    cfg = parse_rlhf_args(base(model_dir) + ["--save", "/tmp/out", "--save_interval", "7",
                                             "--log_interval", "2", "--lr_warmup_fraction", "0.1",
                                             "--max_grad_norm", "0.5"])
    assert cfg.logging.output_dir == "/tmp/out" and cfg.logging.save_steps == 7
    assert cfg.logging.logging_steps == 2 and cfg.training.warmup_ratio == 0.1
    assert cfg.training.clip_grad == 0.5


@pytest.mark.parametrize("argv, pattern", [
    (["--tensor_model_paralel_size", "2"], r"unknown option --tensor_model_paralel_size.*"
                                           r"--tensor_model_parallel_size"),
    (["--use_vllm", "maybe"], r"--use_vllm 'maybe' is not valid: expected true or false"),
    (["--num_generations", "four"], r"--num_generations 'four' is not valid: expected an integer"),
    (["--num_generations", "2.5"], r"--num_generations '2.5' is not valid: expected an integer"),
    (["--epsilon", "x"], r"--epsilon 'x' is not valid: expected a number"),
    (["--epsilon", "0.1", "0.2"], r"--epsilon takes one value, got 2"),
    (["--lr"], r"--lr needs a value"),
    (["positional"], r"unexpected argument 'positional'"),
    (["--vllm_engine_kwargs", "[1]"], r"--vllm_engine_kwargs .*expected a JSON object"),
])
def test_malformed_flags(model_dir, argv, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_rlhf_args(argv + base(model_dir) if argv == ["positional"] else base(model_dir) + argv)


def test_every_option_has_help_and_is_in_help_text():
    table = field_table(GROUPS)
    text = rlhf_help()
    assert len(table) > 80
    for name, info in table.items():
        assert info.help.strip(), f"--{name} has no help text"
        assert f"--{name} " in text
    # Literal choices are printed.
    assert "{grpo,bnpo,dr_grpo,dapo,cispo,sapo,fipo,real}" in text and "{colocate,server}" in text


def test_help_exits(capsys):
    with pytest.raises(SystemExit) as e:
        parse_rlhf_args(["--help"])
    assert e.value.code == 0
    assert "--vllm_gpu_memory_utilization" in capsys.readouterr().out


def test_flat_round_trip(model_dir):
    cfg = parse_rlhf_args(base(model_dir) + ["--steps_per_generation", "2", "--num_generations", "4",
                                             "--resume", "true"])
    flat = cfg.to_flat()
    assert flat["generation_batch_size"] == 32 and "steps_per_generation" not in flat
    again = GRPOConfig.from_flat(json.loads(json.dumps(flat)))
    assert again == cfg
    assert again.logging.resume == "auto"


def test_flat_reports_every_problem_like_the_command_line(model_dir):
    # from_flat (a saved config read back) and a YAML file take one path: aliases resolve,
    # an unknown name gets its suggestion, a bad value and a name set twice are reported,
    # all in one ConfigError.
    flat = parse_rlhf_args(base(model_dir)).to_flat()
    flat.update({"learning_rate": 2e-5, "num_generatons": 4, "micro_batch_size": "x"})
    with pytest.raises(ConfigError) as e:
        GRPOConfig.from_flat(flat)
    text = str(e.value)
    assert "3 problems" in text
    assert "unknown option --num_generatons. Did you mean: --num_generations" in text
    assert "sets lr twice (as 'lr' and 'learning_rate')" in text
    assert "--micro_batch_size 'x' is not valid: expected an integer" in text


def test_epochs_or_train_iters(model_dir, caplog):
    """num_train_epochs: None is 3 passes when --train_iters is not given; both given:
    train_iters decides (ms-swift's Megatron arguments let num_train_epochs win), and a
    warning says so."""
    from megatron_grpo.train.setup import total_steps

    cfg = parse_rlhf_args(base(model_dir, "--num_generations", "4", "--global_batch_size", "8"))
    assert cfg.training.num_train_epochs == 3.0 and cfg.training.train_iters is None
    assert total_steps(cfg, 100) == 100 * 3 // 2          # 2 prompts per rollout of 8
    with caplog.at_level("WARNING", logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(base(model_dir, "--train_iters", "5"))
        assert not caplog.records and cfg.training.num_train_epochs is None
        cfg = parse_rlhf_args(base(model_dir, "--train_iters", "5", "--num_train_epochs", "1"))
    assert total_steps(cfg, 100) == 5
    [record] = caplog.records
    assert "--train_iters 5 and --num_train_epochs 1: the run trains 5 optimizer steps" in \
        record.getMessage()


def test_option_names_are_ms_swift_spellings():
    # A sample of names users type from ms-swift's docs; a rename would break their scripts.
    table = field_table(GROUPS)
    for name in ["tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "sequence_parallel", "micro_batch_size", "global_batch_size", "num_generations",
                 "generation_batch_size", "steps_per_generation", "max_completion_length",
                 "vllm_mode", "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization",
                 "vllm_max_model_len", "vllm_enforce_eager", "vllm_enable_prefix_caching",
                 "vllm_server_host", "vllm_server_port", "vllm_server_base_url", "vllm_server_timeout",
                 "sleep_level", "offload_model", "offload_optimizer", "offload_bridge",
                 "move_model_batches", "importance_sampling_level", "epsilon_high", "delta",
                 "loss_type", "scale_rewards", "advantage_estimator", "kl_in_reward",
                 "top_entropy_quantile", "rollout_importance_sampling_mode",
                 "rollout_importance_sampling_threshold", "log_rollout_offpolicy_metrics",
                 "dynamic_sample", "max_resample_times", "overlong_filter", "reward_weights",
                 "external_plugins", "cosine_min_len_value_wrong", "repetition_max_penalty",
                 "soft_max_length", "soft_cache_length", "log_completions", "log_entropy",
                 "report_to", "num_iterations", "save_steps", "save_total_limit", "logging_steps"]:
        assert name in table, name
    choices = typing.get_args(typing.get_type_hints(GRPOOptions)["loss_type"])
    assert set(choices) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "fipo", "real"}


def test_rollout_server_args(model_dir):
    from megatron_grpo.config import parse_rollout_args

    cfg = parse_rollout_args(["--model", model_dir, "--vllm_tensor_parallel_size", "2",
                              "--vllm_data_parallel_size", "1", "--port", "8123"])
    assert (cfg.vllm_tensor_parallel_size, cfg.port, cfg.host) == (2, 8123, "127.0.0.1")
    with pytest.raises(ValueError, match="--port 70000"):
        parse_rollout_args(["--model", model_dir, "--port", "70000"])
    with pytest.raises(ValueError, match="unknown option --reward_funcs"):
        parse_rollout_args(["--model", model_dir, "--reward_funcs", "format"])
    with pytest.raises(ValueError, match="no config.json"):
        parse_rollout_args(["--model", model_dir + "-missing"])
    cfg = parse_rollout_args(["--model", model_dir, "--vllm_enable_lora", "true",
                              "--vllm_max_lora_rank", "64"])
    assert (cfg.vllm_enable_lora, cfg.vllm_max_lora_rank) == (True, 64)
    with pytest.raises(ValueError, match="--vllm_max_lora_rank 48 is not a rank vLLM can reserve; "
                                         "allowed: 1 8 16"):
        parse_rollout_args(["--model", model_dir, "--vllm_max_lora_rank", "48"])


def test_none_is_a_value_where_it_is_a_choice(model_dir, tmp_path):
    # --scale_rewards none means "do not scale", not "unset" (which would be group for grpo).
    cfg = parse_rlhf_args(base(model_dir) + ["--scale_rewards", "none"])
    assert cfg.grpo.scale_rewards == "none"
    path = tmp_path / "run.yaml"
    path.write_text("scale_rewards: none\nreport_to: none\ntrain_iters: none\n")
    cfg = parse_rlhf_args(base(model_dir) + ["--config", str(path)])
    assert cfg.grpo.scale_rewards == "none" and cfg.logging.report_to == []
    assert cfg.training.train_iters is None


@pytest.mark.parametrize("name", ["quickstart_cpu.yaml", "quickstart_lora_cpu.yaml",
                                  "quickstart_moe_cpu.yaml"])
def test_shipped_configs_parse(name, tmp_path, tiny_model, monkeypatch):
    """Every YAML in configs/ passes the option checks as shipped, world size included (the
    quickstart builds runs/quickstart/tiny-qwen2 or tiny-qwen3-moe first; a tiny model of
    that family with vLLM-CPU's head size stands in)."""
    from megatron_grpo.config import validate_world

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    moe = "moe" in name
    model = tiny_model(family="qwen3_moe", hidden_size=128, head_dim=32) if moe else \
        tiny_model(family="qwen2", hidden_size=128)
    monkeypatch.chdir(root)
    cfg = parse_rlhf_args(["--config", os.path.join("configs", name), "--model", str(model),
                           "--output_dir", str(tmp_path / "out")])
    assert cfg.training.tuner_type == ("lora" if "lora" in name else "full")
    assert cfg.parallel.expert_model_parallel_size == (2 if moe else 1)
    validate_world(cfg, 2)      # tools/quickstart.py runs every config on 2 processes


def test_options_shared_by_commands_share_their_default():
    """`megatron rollout` / `megatron export` take their shared options from the rlhf groups
    (groups.same_as): one default each. The one exception is documented in its help."""
    from megatron_grpo.config.export import ExportConfig
    from megatron_grpo.config.rollout_server import RolloutServerConfig

    rlhf = field_table(GROUPS)
    shared = 0
    for cls, group in ((RolloutServerConfig, "server"), (ExportConfig, "export")):
        for name, info in field_table({group: cls}).items():
            if name in rlhf and name != "vllm_max_lora_rank":   # rlhf: None = the adapter's rank
                shared += 1
                assert info.default == rlhf[name].default, (cls.__name__, name)
    assert shared >= 20
