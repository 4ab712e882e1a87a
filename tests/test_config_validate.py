"""Every configuration check: its message names the option, the value and what is valid."""
import json
import logging
import os

import pytest

from megatron_grpo.config import parse_rlhf_args, valid_num_generations, validate_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "countdown.jsonl")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(d)


def args(model_dir, *extra, reward=("countdown",)):
    return ["--model", model_dir, "--dataset", COUNTDOWN, "--reward_funcs", *reward, *extra]


def error_of(argv):
    with pytest.raises(ValueError) as e:
        parse_rlhf_args(argv)
    return str(e.value)


# (extra flags, substrings the message must contain)
CASES = [
    # unknown choices list the valid ones
    (["--loss_type", "ppo"], ["--loss_type 'ppo'", "grpo, bnpo, dr_grpo, dapo, cispo"]),
    (["--rlhf_type", "dpo"], ["--rlhf_type 'dpo'", "grpo"]),
    (["--importance_sampling_level", "tok"], ["--importance_sampling_level", "token, sequence, sequence_token"]),
    (["--scale_rewards", "std"], ["--scale_rewards 'std'", "group, batch, none, gdpo"]),
    (["--advantage_estimator", "ppo"], ["--advantage_estimator", "grpo, rloo, reinforce_plus_plus"]),
    (["--rollout_importance_sampling_mode", "clip"], ["--rollout_importance_sampling_mode",
                                                      "token_truncate, token_mask"]),
    (["--vllm_mode", "remote"], ["--vllm_mode 'remote'", "colocate, server"]),
    (["--sleep_level", "3"], ["--sleep_level 3", "0, 1, 2"]),
    (["--lr_decay_style", "step"], ["--lr_decay_style", "cosine, linear, constant"]),
    (["--report_to", "mlflow"], ["--report_to 'mlflow'", "tensorboard, wandb, swanlab, none"]),
    (["--report_to", "none", "tensorboard"], ["--report_to none tensorboard", "cannot be combined"]),
    (["--tuner_type", "lora", "--lora_rank", "0"], ["--lora_rank 0"]),
    (["--tuner_type", "lora", "--lora_alpha", "-1"], ["--lora_alpha -1", "> 0"]),
    (["--tuner_type", "lora", "--lora_dropout", "1.5"], ["--lora_dropout 1.5", "[0, 1)"]),
    (["--tuner_type", "lora", "--target_modules", "q_proj", "qkv"],
     ["--target_modules q_proj qkv", "['qkv']", "all-linear", "q_proj k_proj v_proj o_proj"]),
    (["--tuner_type", "lora", "--modules_to_save", "lm_head", "score"],
     ["--modules_to_save lm_head score", "['score']", "embed_tokens lm_head"]),
    (["--tuner_type", "lora", "--modules_to_save", "lm_head", "--vllm_enable_lora", "true"],
     ["--modules_to_save lm_head with --vllm_enable_lora true", "--vllm_enable_lora false"]),
    (["--tuner_type", "lora", "--adapters", "/nonexistent"],
     ["--adapters '/nonexistent'", "adapter_config.json"]),
    (["--merge_lora", "true"], ["--merge_lora True", "needs --tuner_type lora"]),
    (["--vllm_enable_lora", "true"], ["--vllm_enable_lora true needs --tuner_type lora",
                                      "'full'"]),
    (["--vllm_max_lora_rank", "16"], ["--vllm_max_lora_rank 16 needs --vllm_enable_lora true"]),
    (["--tuner_type", "lora", "--vllm_enable_lora", "true", "--vllm_max_lora_rank", "24"],
     ["--vllm_max_lora_rank 24", "allowed: 1 8 16 32 64 128 256 320 512"]),
    (["--tuner_type", "lora", "--lora_rank", "64", "--vllm_enable_lora", "true",
      "--vllm_max_lora_rank", "32"], ["--vllm_max_lora_rank 32 is below the adapter's rank 64",
                                      "--vllm_max_lora_rank 64"]),
    (["--tuner_type", "lora", "--lora_rank", "1024", "--vllm_enable_lora", "true"],
     ["--lora_rank 1024 is above vLLM's largest LoRA rank 512"]),
    (["--tuner_type", "lora", "--vllm_enable_lora", "true", "--sleep_level", "2"],
     ["--sleep_level 2 with --vllm_enable_lora true", "allowed: --sleep_level 0 or 1"]),
    (["--train_type", "qlora"], ["--tuner_type 'qlora'", "full, lora"]),
    (["--kl_estimator", "k4"], ["--kl_estimator", "k1, k2, k3"]),
    # batch sizes
    (["--num_generations", "5"], ["--num_generations 5", "Valid num_generations values: [2, 4, 8, 16]"]),
    (["--num_generations", "1"], ["--num_generations 1", "at least 2"]),
    (["--num_generations", "5", "--global_batch_size", "4", "--steps_per_generation", "3"],
     ["--num_generations 5", "[2, 3, 4, 6, 12]"]),     # generation batch 12 = 4 x 3
    (["--generation_batch_size", "32", "--steps_per_generation", "3"],
     ["--generation_batch_size 32", "--steps_per_generation 3", "disagree", "16 x steps_per_generation 3 = 48"]),
    (["--generation_batch_size", "24"], ["--generation_batch_size 24", "multiple of --global_batch_size 16"]),
    (["--global_batch_size", "10", "--micro_batch_size", "4"], ["--micro_batch_size 4", "[1, 2, 5, 10]"]),
    # rollout
    (["--use_vllm", "false", "--vllm_mode", "server"], ["--vllm_mode server", "--use_vllm is false",
                                                        "--use_vllm true"]),
    (["--use_vllm", "false"], ["--use_vllm false", "--use_vllm true"]),
    (["--vllm_gpu_memory_utilization", "1.5"], ["--vllm_gpu_memory_utilization 1.5", "(0, 1]"]),
    (["--vllm_max_model_len", "100", "--max_completion_length", "128"], ["--vllm_max_model_len 100"]),
    (["--temperature", "0"], ["--temperature 0"]),
    (["--top_p", "0"], ["--top_p 0", "(0, 1]"]),
    (["--top_k", "-2"], ["--top_k -2", "-1 or 0 disable it"]),
    (["--vllm_mode", "server", "--vllm_server_host", "a", "b", "c", "--vllm_server_port", "1", "2"],
     ["--vllm_server_port 1 2 must give one port, or one per host (3 hosts: a b c)"]),
    (["--vllm_mode", "server", "--vllm_server_base_url", "localhost:8000"],
     ["--vllm_server_base_url 'localhost:8000'", "http://"]),
    # loss
    (["--epsilon", "0.2", "--epsilon_high", "0.1"], ["--epsilon_high 0.1", "--epsilon 0.2", ">= 0.2"]),
    (["--delta", "0.5"], ["--delta 0.5", "> 1"]),
    (["--beta", "-1"], ["--beta -1"]),
    (["--top_entropy_quantile", "0"], ["--top_entropy_quantile 0", "(0, 1]"]),
    # rewards
    (["--reward_weights", "1", "2"], ["--reward_weights [1.0, 2.0]", "2 values", "name 1"]),
    (["--cosine_max_len", "0"], ["--cosine_max_len 0", ">= 1"]),
    (["--repetition_max_penalty", "0.5"], ["--repetition_max_penalty 0.5", "<= 0"]),
    (["--external_plugins", "/nonexistent/plugin.py"], ["--external_plugins '/nonexistent/plugin.py'",
                                                        "not found"]),
    # training / parallel / logging
    (["--lr_warmup_iters", "5", "--warmup_ratio", "0.1"], ["--lr_warmup_iters 5", "--warmup_ratio 0.1",
                                                          "exclusive"]),
    (["--min_lr", "1"], ["--min_lr 1"]),
    (["--virtual_pipeline_model_parallel_size", "2"], ["--virtual_pipeline_model_parallel_size 2",
                                                       "--pipeline_model_parallel_size > 1"]),
    (["--tensor_model_parallel_size", "0"], ["--tensor_model_parallel_size 0", ">= 1"]),
    (["--save_steps", "0"], ["--save_steps 0", ">= 1"]),
    (["--resume", "/nonexistent/ckpt"], ["--resume '/nonexistent/ckpt'", "true/auto"]),
    # vision-language freezing: only on a VL model, never everything
    (["--freeze_vit", "false"], ["--freeze_vit false", "text-only"]),
    (["--freeze_llm", "true"], ["--freeze_llm true", "nothing to train"]),
    (["--freeze_aligner", "false", "--tuner_type", "lora"], ["--freeze_aligner false", "text-only"]),
    (["--tuner_type", "lora_llm"], ["--tuner_type lora_llm", "text-only", "Fix: --tuner_type lora"]),
    (["--tuner_type", "lora_llm", "--freeze_llm", "true"],
     ["--freeze_llm true with --tuner_type lora_llm", "Fix: --freeze_llm false"]),
    (["--tuner_type", "lora_llm", "--vllm_enable_lora", "true"],
     ["--vllm_enable_lora true with --tuner_type lora_llm", "--vllm_enable_lora false"]),
]


@pytest.mark.parametrize("extra, expected", CASES, ids=[" ".join(c[0])[:40] for c in CASES])
def test_config_errors(model_dir, extra, expected):
    message = error_of(args(model_dir, *extra))
    for part in expected:
        assert part in message, f"{part!r} not in: {message}"


def test_reward_name_and_requirements(model_dir):
    msg = error_of(args(model_dir, reward=("acuracy",)))
    assert "--reward_funcs 'acuracy'" in msg
    for name in ["accuracy", "cosine", "countdown", "format", "repetition", "soft_overlong"]:
        assert name in msg
    msg = error_of(["--model", model_dir, "--dataset", COUNTDOWN])
    assert "--reward_funcs is required" in msg and "accuracy" in msg
    msg = error_of(args(model_dir, reward=("soft_overlong",)))
    assert "--soft_cache_length" in msg
    msg = error_of(args(model_dir, "--soft_cache_length", "600", reward=("soft_overlong",)))
    assert "--soft_cache_length 600" in msg and "soft_max_length=512" in msg


def test_model_and_dataset_errors(model_dir, tmp_path):
    msg = error_of(["--dataset", COUNTDOWN, "--reward_funcs", "format"])
    assert "--model is required" in msg
    msg = error_of(args(str(tmp_path / "nope")))
    assert "folder not found" in msg and "nope" in msg
    empty = tmp_path / "empty_model"
    empty.mkdir()
    msg = error_of(args(str(empty)))
    assert "has no config.json" in msg and "--model" in msg
    msg = error_of(["--model", model_dir, "--dataset", str(tmp_path / "missing.jsonl"),
                    "--reward_funcs", "format"])
    assert "--dataset" in msg and "missing.jsonl" in msg and "not found" in msg
    msg = error_of(["--model", model_dir, "--dataset", f"{COUNTDOWN}#ten", "--reward_funcs", "format"])
    assert "#N suffix" in msg and "'ten'" in msg
    (tmp_path / "d.csv").write_text("a,b\n")
    msg = error_of(["--model", model_dir, "--dataset", str(tmp_path / "d.csv"), "--reward_funcs", "format"])
    assert ".jsonl, .json, .parquet" in msg
    msg = error_of(["--model", model_dir, "--reward_funcs", "format"])
    assert "--dataset is required" in msg


def test_bad_config_fails(model_dir):
    # That this happens before anything heavy is imported: tests/test_cli_errors.py.
    assert "--num_generations" in error_of(args(model_dir, "--num_generations", "5"))


def test_server_mode_forces_sleep_level_0(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(args(model_dir, "--vllm_mode", "server", "--sleep_level", "2"))
    assert cfg.rollout.sleep_level == 0
    assert any("sleep_level" in r.message and "server" in r.message for r in caplog.records)
    assert cfg.rollout.vllm_server_host == ["127.0.0.1"] and cfg.rollout.vllm_server_port == [8000]


def test_sequence_parallel_without_tp_is_turned_off(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(args(model_dir, "--sequence_parallel", "true"))
    assert cfg.parallel.sequence_parallel is False
    assert any("sequence_parallel" in r.message for r in caplog.records)


def test_gdpo_turns_kl_in_reward_off(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(args(model_dir, "--advantage_estimator", "rloo",
                                   "--scale_rewards", "gdpo"))
    assert cfg.grpo.kl_in_reward is False
    assert any("kl_in_reward" in r.message for r in caplog.records)


def test_derived_defaults(model_dir, tmp_path):
    cfg = parse_rlhf_args(args(model_dir, "--advantage_estimator", "rloo"))
    assert cfg.grpo.kl_in_reward is True and cfg.grpo.scale_rewards == "none"
    cfg = parse_rlhf_args(args(model_dir, "--advantage_estimator", "reinforce_plus_plus"))
    assert cfg.grpo.scale_rewards == "batch"
    cfg = parse_rlhf_args(args(model_dir, "--generation_batch_size", "64", "--num_generations", "4"))
    assert cfg.grpo.steps_per_generation == 4
    cfg = parse_rlhf_args(args(model_dir, "--steps_per_generation", "3", "--num_generations", "4"))
    assert cfg.grpo.generation_batch_size == 48
    system = tmp_path / "system.txt"
    system.write_text("Be brief.\n")
    cfg = parse_rlhf_args(args(model_dir, "--system", str(system), "--soft_cache_length", "64",
                               reward=("soft_overlong",)))
    assert cfg.data.system == "Be brief."
    assert cfg.reward.soft_max_length == 512 and cfg.reward.cosine_max_len == 512


def test_valid_num_generations_helper():
    assert valid_num_generations(12) == [2, 3, 4, 6, 12]
    assert valid_num_generations(16, dp=2) == [2, 4, 8]     # 16/G prompts must split over 2 ranks


def test_world_checks(model_dir):
    cfg = parse_rlhf_args(args(model_dir, "--tensor_model_parallel_size", "2", "--num_generations", "4"))
    plan = validate_world(cfg, 4)
    assert (plan.dp, plan.num_microbatches, plan.num_rollout_prompts, plan.prompts_per_dp_rank,
            plan.num_vllm_engines) == (2, 8, 4, 2, 4)
    with pytest.raises(ValueError) as e:
        validate_world(cfg, 3)
    msg = str(e.value)
    assert "world size 3" in msg and "tensor_model_parallel_size 2" in msg and "[2, 4, 6, 8]" in msg
    assert "[1, 3]" in msg    # TP x PP x CP products that 3 ranks allow

    cfg = parse_rlhf_args(args(model_dir, "--global_batch_size", "6", "--num_generations", "2"))
    with pytest.raises(ValueError) as e:
        validate_world(cfg, 4)
    msg = str(e.value)
    assert "--global_batch_size 6" in msg and "= 4" in msg and "[4, 8, 12, 16]" in msg

    # 16 completions / 8 per group = 2 prompts cannot be split over 4 DP ranks
    cfg = parse_rlhf_args(args(model_dir, "--num_generations", "8"))
    with pytest.raises(ValueError) as e:
        validate_world(cfg, 4)
    msg = str(e.value)
    assert "--num_generations 8" in msg and "Valid num_generations values: [2, 4]" in msg

    cfg = parse_rlhf_args(args(model_dir, "--vllm_tensor_parallel_size", "3", "--num_generations", "4"))
    with pytest.raises(ValueError) as e:
        validate_world(cfg, 4)
    msg = str(e.value)
    assert "--vllm_tensor_parallel_size 3" in msg and "[1, 2, 4]" in msg
    # server mode: the server's vLLM TP is not the trainer's concern
    cfg = parse_rlhf_args(args(model_dir, "--vllm_tensor_parallel_size", "3", "--vllm_mode", "server",
                               "--num_generations", "4"))
    assert validate_world(cfg, 4).num_vllm_engines == 0


def test_generation_batch_size_with_a_consistent_steps_per_generation(model_dir):
    # ms-swift accepts both when they agree.
    cfg = parse_rlhf_args(args(model_dir, "--generation_batch_size", "32", "--steps_per_generation", "2"))
    assert (cfg.grpo.generation_batch_size, cfg.grpo.steps_per_generation) == (32, 2)


def test_tuner_type_and_train_type_alias(model_dir):
    assert parse_rlhf_args(args(model_dir, "--tuner_type", "full")).training.tuner_type == "full"
    assert parse_rlhf_args(args(model_dir, "--train_type", "full")).training.tuner_type == "full"


def test_top_k_zero_means_disabled(model_dir):
    # vLLM reads 0 and -1 alike; the engines accept only -1.
    assert parse_rlhf_args(args(model_dir, "--top_k", "0")).rollout.top_k == -1
    assert parse_rlhf_args(args(model_dir, "--top_k", "20")).rollout.top_k == 20


def test_report_to_default_none_and_missing_packages(model_dir, monkeypatch, caplog):
    import importlib.util

    from megatron_grpo.config import validate

    assert parse_rlhf_args(args(model_dir, "--report_to", "none")).logging.report_to == []
    # As a YAML/flag string too: `none` is a choice here, not the "unset" of an Optional.
    assert parse_rlhf_args(args(model_dir, "--report_to=none")).logging.report_to == []

    real = importlib.util.find_spec
    installed = {"tensorboard": real("tensorboard") is not None}

    def find_spec(name, *a, **k):
        if name in ("tensorboard", "wandb", "swanlab") and not installed.get(name, False):
            return None
        return real(name, *a, **k)

    monkeypatch.setattr(validate.importlib.util, "find_spec", find_spec)
    if installed["tensorboard"]:
        assert parse_rlhf_args(args(model_dir)).logging.report_to == ["tensorboard"]
    # Default sink missing: a one-line warning, metrics.jsonl only.
    installed["tensorboard"] = False
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        cfg = parse_rlhf_args(args(model_dir))
    assert cfg.logging.report_to == []
    warnings = [r.message for r in caplog.records if "tensorboard" in r.message]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "metrics.jsonl" in warnings[0]
    # Asked for by name and missing: an error naming the package to install.
    msg = error_of(args(model_dir, "--report_to", "tensorboard", "swanlab"))
    assert "--report_to tensorboard needs the tensorboard package" in msg
    assert "pip install tensorboard" in msg and "pip install swanlab" in msg


@pytest.mark.parametrize("spec", ["AI-MO/NuminaMath-TIR", "modelscope/xxx#1000",
                                  "AI-ModelScope/alpaca-gpt4-data-zh:default#500"])
def test_hub_dataset_id_says_datasets_are_not_downloaded(model_dir, spec):
    msg = error_of(["--model", model_dir, "--dataset", spec, "--reward_funcs", "format"])
    assert f"--dataset {spec!r}" in msg and "does not download datasets" in msg
    assert ".jsonl/.json/.parquet" in msg and "#N" in msg


def test_dataset_folder(model_dir, tmp_path):
    msg = error_of(["--model", model_dir, "--dataset", str(tmp_path), "--reward_funcs", "format"])
    assert "is a folder" in msg and "data files" in msg


def test_every_problem_in_one_message(model_dir):
    msg = error_of(args(model_dir, "--tensor_model_paralel_size", "2", "--lerning_rate", "1e-6",
                        "--loss_type", "ppo", "--num_generations", "four", "--beta", "-1",
                        "--top_p", "0", "--save_steps", "0"))
    lines = msg.splitlines()
    assert lines[0] == "7 problems in the configuration:", msg
    # Unknown flags first, each with its suggestion, then the invalid values.
    assert "unknown option --tensor_model_paralel_size" in lines[1]
    assert "--tensor_model_parallel_size" in lines[1]
    assert "unknown option --lerning_rate" in lines[2] and "--learning_rate" in lines[2]
    rest = "\n".join(lines[3:])
    for part in ["--loss_type 'ppo'", "--num_generations 'four' is not valid", "--beta -1",
                 "--top_p 0", "--save_steps 0"]:
        assert part in rest, (part, msg)


def test_no_consequences_of_a_value_already_reported(model_dir):
    # num_generations could not be read: the default 8 that stands in for it does not
    # divide 12, but that is not the user's mistake and must not be reported.
    msg = error_of(args(model_dir, "--num_generations", "four", "--generation_batch_size", "12",
                        "--global_batch_size", "4"))
    assert "problems" not in msg and "--num_generations 'four'" in msg
    # A misspelt flag: errors about the default of the option it probably meant are left out.
    msg = error_of(args(model_dir, "--num_generatons", "4", "--generation_batch_size", "12",
                        "--global_batch_size", "4"))
    assert "problems" not in msg and "--num_generatons" in msg
    # Sizes reported as invalid do not crash the checks that divide by them.
    msg = error_of(args(model_dir, "--micro_batch_size", "0", "--global_batch_size", "0",
                        "--num_generations", "0"))
    assert "--micro_batch_size 0" in msg and "--global_batch_size 0" in msg
    assert "--num_generations 0" in msg


def test_world_size_problems_join_the_option_problems(model_dir):
    with pytest.raises(ValueError) as e:
        parse_rlhf_args(args(model_dir, "--tensor_model_parallel_size", "3", "--beta", "-1"),
                        world_size=2)
    msg = str(e.value)
    assert "2 problems" in msg and "--beta -1" in msg and "world size 2" in msg
    # A parallel size already reported as invalid: no world check on it (and no crash).
    with pytest.raises(ValueError) as e:
        parse_rlhf_args(args(model_dir, "--tensor_model_parallel_size", "0"), world_size=2)
    assert "world size" not in str(e.value)
    cfg = parse_rlhf_args(args(model_dir, "--num_generations", "4"), world_size=2)
    assert validate_world(cfg, 2).dp == 2


def test_yaml_and_flag_problems_together(model_dir, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_generatons: 4\nepsilon: 2\nloss_type: ppo\n")
    msg = error_of(args(model_dir, "--config", str(path), "--lr", "x", "--loss_type", "dapo"))
    assert "3 problems" in msg, msg
    assert "unknown option --num_generatons" in msg and "--lr 'x'" in msg and "--epsilon 2" in msg
    assert "ppo" not in msg           # the flag overrides the file's value


def test_vllm_lora_rank_defaults_to_the_smallest_that_fits(model_dir, tmp_path):
    cfg = parse_rlhf_args(args(model_dir, "--tuner_type", "lora", "--lora_rank", "12",
                               "--vllm_enable_lora", "true"))
    assert cfg.rollout.vllm_max_lora_rank == 16
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 64, "lora_alpha": 16}))
    cfg = parse_rlhf_args(args(model_dir, "--tuner_type", "lora", "--adapters", str(adapter),
                               "--vllm_enable_lora", "true"))
    assert cfg.rollout.vllm_max_lora_rank == 64     # the adapter's r, not --lora_rank


@pytest.mark.parametrize("extra, expected", [
    ({"tie_word_embeddings": True}, "lm_head is tied to embed_tokens (tie_word_embeddings)"),
    ({"vision_config": {}}, "a vision-language model")])
def test_modules_to_save_refused_for_tied_and_vl_models(tmp_path, extra, expected):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", **extra}))
    msg = error_of(args(str(d), "--tuner_type", "lora", "--modules_to_save", "embed_tokens"))
    assert f"--modules_to_save embed_tokens with --model {str(d)!r}: {expected}" in msg
    assert "allowed: untied text models" in msg
    parse_rlhf_args(args(str(d), "--tuner_type", "lora"))   # without it: fine


def test_modules_to_save_accepted(model_dir):
    cfg = parse_rlhf_args(args(model_dir, "--tuner_type", "lora", "--modules_to_save",
                               "lm_head", "embed_tokens"))
    assert cfg.training.modules_to_save == ["lm_head", "embed_tokens"]


def test_vllm_lora_refused_for_moe(tmp_path):
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    message = error_of(args(str(d), "--tuner_type", "lora", "--vllm_enable_lora", "true"))
    assert "--vllm_enable_lora true with the mixture-of-experts model" in message
    assert "--vllm_enable_lora false" in message
    # LoRA on an MoE model: the attention's linears only (model/lora.py has no adapters for
    # the experts; all-linear used to fail at the model build).
    message = error_of(args(str(d), "--tuner_type", "lora"))
    assert ("--tuner_type lora --target_modules all-linear with the mixture-of-experts model"
            in message and "--target_modules q_proj k_proj v_proj o_proj" in message), message
    cfg = parse_rlhf_args(args(str(d), "--tuner_type", "lora", "--target_modules", "q_proj",
                               "v_proj"))
    assert cfg.training.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("dtype_keys, flag, expected", [
    ({"torch_dtype": "bfloat16"}, None, True),       # ms-swift: the dtype follows the checkpoint
    ({"dtype": "bfloat16"}, None, True),             # transformers 5 writes `dtype`
    ({"text_config": {"torch_dtype": "bfloat16"}}, None, True),   # a VL model's text part
    ({"torch_dtype": "float16"}, None, True),        # fp16 is not trained: bf16 instead
    ({"torch_dtype": "float32"}, None, False),
    ({}, None, False),                               # no dtype named: float32
    ({"torch_dtype": "bfloat16"}, "false", False),   # an explicit flag wins
    ({"torch_dtype": "float32"}, "true", True),
])
def test_bf16_follows_the_model_dtype_unless_set(tmp_path, dtype_keys, flag, expected):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", **dtype_keys}))
    extra = ("--bf16", flag) if flag is not None else ()
    assert parse_rlhf_args(args(str(d), *extra)).training.bf16 is expected


@pytest.mark.parametrize("has_bf16, warned", [(False, True), (True, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_warns(model_dir, monkeypatch, caplog,
                                                       has_bf16, warned):
    import megatron_grpo.config.validate as validate

    monkeypatch.setattr(validate, "vllm_is_cpu_build", lambda: True)     # a CPU machine
    monkeypatch.setattr(validate, "cpu_has_bf16", lambda: has_bf16)      # its flags, faked
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        assert parse_rlhf_args(args(model_dir, "--bf16", "true")).training.bf16 is True
        parse_rlhf_args(args(model_dir, "--bf16", "false"))
    hits = [r.message for r in caplog.records if "without bfloat16 instructions" in r.message]
    assert len(hits) == (1 if warned else 0)
    assert all("Fix: --bf16 false" in h for h in hits)


def _model_folder(root, name, **config):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 999, **config}))
    return str(d)


def test_teacher_model_options(tmp_path):
    """--teacher_model (on-policy distillation): --reward_funcs optional; a teacher of
    another vocabulary, a vision-language teacher of a text policy, an MoE teacher whose
    experts the EP size does not divide, a missing folder, and the options of one advantage per completion are
    refused with the fix."""
    student = _model_folder(tmp_path, "student")
    teacher = _model_folder(tmp_path, "teacher", num_hidden_layers=4)
    cfg = parse_rlhf_args(["--model", student, "--dataset", COUNTDOWN, "--teacher_model", teacher,
                           "--teacher_kl_coef", "0.5"])
    assert (cfg.model.teacher_model, cfg.grpo.teacher_kl_coef, cfg.reward.reward_funcs) == \
        (teacher, 0.5, [])
    with_reward = parse_rlhf_args(args(student, "--teacher_model", teacher))
    assert with_reward.reward.reward_funcs == ["countdown"]
    # One completion per prompt (ms-swift's opd_rl.sh): the teacher needs no group.
    single = parse_rlhf_args(args(student, "--teacher_model", teacher, "--num_generations", "1"))
    assert single.grpo.num_generations == 1
    assert "(1 with --teacher_model)" in error_of(args(student, "--num_generations", "1"))
    cases = [
        (["--teacher_model", _model_folder(tmp_path, "other_vocab", vocab_size=151936)],
         ["has vocab_size 151936", "--model", "999", "one vocabulary"]),
        (["--teacher_model", _model_folder(tmp_path, "vl", model_type="qwen2_5_vl",
                                           vision_config={})],
         ["(qwen2_5_vl) for --model", "(qwen2): a vision-language policy needs a teacher of its "
          "own model type, which sees its images, and a text policy a text teacher"]),
        (["--teacher_model", _model_folder(tmp_path, "moe6", num_experts=6),
          "--expert_model_parallel_size", "4"],
         ["has 6 experts, which --expert_model_parallel_size 4 does not divide"]),
        (["--teacher_model", str(tmp_path / "nowhere")], ["no config.json there"]),
        (["--teacher_model", teacher, "--loss_type", "real", "--micro_batch_size", "8"],
         ["--teacher_model with --loss_type real", "advantage per completion"]),
        (["--teacher_model", teacher, "--off_policy_sequence_mask_delta", "0.1"],
         ["--teacher_model with --off_policy_sequence_mask_delta 0.1"]),
    ]
    for extra, expected in cases:
        message = error_of(args(student, *extra))
        for part in expected:
            assert part in message, (extra, message)
    # Tokenizers: every token of the policy's must keep its id in the teacher's (more added
    # tokens in the teacher's are fine); a vocab_size alike is not enough.
    def tokenizer(folder, vocab, added=()):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump({"model": {"type": "BPE", "vocab": vocab},
                       "added_tokens": [{"id": i, "content": c} for c, i in added]}, f)
    tokenizer(student, {"a": 0, "b": 1, "ab": 2}, [("<|end|>", 3)])
    tokenizer(teacher, {"a": 0, "b": 1, "ab": 2}, [("<|end|>", 3), ("<think>", 4)])
    assert parse_rlhf_args(args(student, "--teacher_model", teacher)).model.teacher_model == teacher
    other = _model_folder(tmp_path, "other_tokenizer")
    tokenizer(other, {"a": 0, "ab": 1, "b": 2}, [("<|end|>", 3)])
    message = error_of(args(student, "--teacher_model", other))
    assert "its tokenizer gives 2 of --model's 4 tokens other ids or none" in message, message
    vl = _model_folder(tmp_path, "vl_policy", model_type="qwen2_5_vl", vision_config={})
    vl_teacher = _model_folder(tmp_path, "vl_teacher", model_type="qwen2_5_vl", vision_config={})
    assert parse_rlhf_args(args(vl, "--teacher_model", vl_teacher)).model.teacher_model == vl_teacher
    assert "a vision-language policy needs a teacher of its own model type" in error_of(
        args(vl, "--teacher_model", teacher))
    assert "--offload_teacher_model true needs --teacher_model" in error_of(
        args(student, "--offload_teacher_model", "true"))
    message = error_of(["--model", student, "--dataset", COUNTDOWN, "--teacher_model", teacher,
                        "--dynamic_sample", "true", "--scale_rewards", "gdpo"])
    assert "--dynamic_sample true needs --reward_funcs" in message
    assert "--scale_rewards gdpo needs --reward_funcs" in message


def test_teacher_model_server_options(tmp_path):
    """--teacher_model_server: a URL or ms-swift's JSON list of teachers with their tags;
    malformed lists, several teachers without tags or sharing one, a local teacher beside it,
    --offload_teacher_model and a vision-language policy are refused with the fix."""
    from megatron_grpo.config.validate import TeacherServer, route_rows, teacher_servers
    from megatron_grpo.data.loading import PromptDataset

    student = _model_folder(tmp_path, "student")
    cfg = parse_rlhf_args(["--model", student, "--dataset", COUNTDOWN, "--num_generations", "1",
                           "--teacher_model_server", "http://127.0.0.1:8000/"])
    assert (cfg.model.has_teacher, cfg.reward.reward_funcs, cfg.model.teacher_tag_key) == \
        (True, [], "dataset")
    assert teacher_servers(cfg.model.teacher_model_server) == \
        [TeacherServer("http://127.0.0.1:8000", ())]
    two = '[{"url": "http://t1:8000", "tags": ["a.jsonl"]}, {"url": "http://t2:8001", "tags": [7]}]'
    assert teacher_servers(two) == [TeacherServer("http://t1:8000", ("a.jsonl",)),
                                    TeacherServer("http://t2:8001", ("7",))]
    cases = [
        ("localhost:8000", "url 'localhost:8000' must start with http:// or https://"),
        ("[{'url': 1}]", "--teacher_model_server is not valid JSON"),
        ("[]", "the JSON list needs one object"),
        ('[{"url": "http://a:1"}, {"url": "http://b:1", "tags": ["x"]}]',
         "with several teachers each needs its tags"),
        ('[{"url": "http://a:1", "tags": ["x"]}, {"url": "http://b:1", "tags": ["x"]}]',
         "tag 'x' belongs to teachers 0 and 1"),
        ('[{"url": "http://a:1", "tags": "x"}]', "teacher 0: tags 'x' must be a list"),
    ]
    for value, expected in cases:
        message = error_of(args(student, "--teacher_model_server", value))
        assert expected in message, (value, message)
    assert "one teacher, local or served" in error_of(
        args(student, "--teacher_model_server", "http://a:1", "--teacher_model", student))
    assert "--offload_teacher_model true needs --teacher_model: a served teacher" in error_of(
        args(student, "--teacher_model_server", "http://a:1", "--offload_teacher_model", "true"))
    assert "--teacher_model_server with --loss_type real" in error_of(
        args(student, "--teacher_model_server", "http://a:1", "--loss_type", "real",
             "--micro_batch_size", "8"))
    vl = _model_folder(tmp_path, "vl_policy", model_type="qwen2_5_vl", vision_config={})
    assert "a served teacher is sent token ids only" in error_of(
        args(vl, "--teacher_model_server", "http://a:1"))
    # Routing: by a column, or by the --dataset entry of each row; a row no tags name fails.
    data = PromptDataset(messages=[[]] * 3, columns={"domain": ["x", "y", "x"]},
                         sources=["m.jsonl", "c.jsonl", "m.jsonl"])
    servers = teacher_servers('[{"url": "http://a:1", "tags": ["m.jsonl", "y"]}, '
                              '{"url": "http://b:1", "tags": ["c.jsonl", "x"]}]')
    assert route_rows(servers, data, "dataset") == [0, 1, 0]
    assert route_rows(servers, data, "domain") == [1, 0, 1]
    assert route_rows(servers[:1], data, "nothing") == [0, 0, 0]     # the only teacher
    with pytest.raises(ValueError, match="a prompt of c.jsonl has --dataset entry 'c.jsonl', "
                                         r"which no teacher's tags hold \(\['m.jsonl', 'q'\]\)"):
        route_rows([TeacherServer("http://a:1", ("m.jsonl",)), TeacherServer("http://b:1", ("q",))],
                   data, "dataset")
    with pytest.raises(ValueError, match="--teacher_tag_key 'nothing': the dataset has no such"):
        route_rows(servers, data, "nothing")


def test_freeze_parameters_options(tmp_path):
    """--freeze_parameters* / --trainable_parameters* (model/freeze.py): full training only,
    regexes that compile, a ratio in [0, 1) and not under pipeline or expert parallelism."""
    student = _model_folder(tmp_path, "student")
    cfg = parse_rlhf_args(args(student, "--freeze_parameters", "embedding", "decoder.layers.0",
                               "--trainable_parameters_regex", r"mlp\.linear_fc2",
                               "--freeze_parameters_ratio", "0.25"))
    t = cfg.training
    assert (t.freeze_parameters, t.trainable_parameters_regex, t.freeze_parameters_ratio) == \
        (["embedding", "decoder.layers.0"], r"mlp\.linear_fc2", 0.25)
    cases = [
        (["--freeze_parameters", "embedding", "--tuner_type", "lora"],
         "--freeze_parameters with --tuner_type lora: they choose what trains in full-parameter"),
        (["--freeze_parameters_regex", "layers.("],
         "--freeze_parameters_regex 'layers.(' is not a regular expression"),
        (["--freeze_parameters_ratio", "1"], "--freeze_parameters_ratio 1.0 is not valid"),
        (["--freeze_parameters_ratio", "0.5", "--pipeline_model_parallel_size", "2"],
         "--freeze_parameters_ratio 0.5 with --pipeline_model_parallel_size 2"),
    ]
    for extra, expected in cases:
        message = error_of(args(student, *extra))
        assert expected in message, (extra, message)


def test_ref_model_options(tmp_path):
    """--ref_model: the KL term's reference, checked as a teacher is (vocabulary, kind,
    folder); refused with --beta 0, which has no KL term."""
    student = _model_folder(tmp_path, "student")
    ref = _model_folder(tmp_path, "ref", num_hidden_layers=4)
    assert parse_rlhf_args(args(student, "--ref_model", ref)).model.ref_model == ref
    cases = [
        (["--ref_model", ref, "--beta", "0"], "--ref_model " + repr(ref) + " with --beta 0"),
        (["--ref_model", _model_folder(tmp_path, "other_vocab", vocab_size=151936)],
         "has vocab_size 151936, --model"),
        (["--ref_model", str(tmp_path / "nowhere")], "no config.json there"),
        (["--ref_adapters", str(tmp_path)], "--ref_adapters " + repr(str(tmp_path))
         + ": no adapter_config.json there"),
        (["--ref_adapters", "a", "b"], "--ref_adapters a b: one adapter folder is allowed"),
        (["--ref_adapters", "a", "--beta", "0"], "--ref_adapters 'a' with --beta 0"),
        (["--ref_model", _model_folder(tmp_path, "vl", model_type="qwen2_5_vl",
                                       vision_config={})],
         "a vision-language policy needs a reference of its own model type"),
    ]
    for extra, expected in cases:
        message = error_of(args(student, *extra))
        assert expected in message, (extra, message)


def test_expert_tensor_parallel_defaults_to_one_as_ms_swifts_moe_scripts_need(tiny_model):
    """ms-swift's full-parameter MoE example (TP 4, EP 4, PP 2 on 8 GPUs) relies on its
    default --expert_tensor_parallel_size 1; Megatron-LM's default (the TP size) made it
    "world size 8 is not divisible by ETP 4 x EP 4 x PP 2"."""
    from megatron_grpo.config import build_config

    moe = str(tiny_model(family="qwen3_moe", num_layers=2, hidden_size=128,
                         num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
                         vocab_size=999, head_dim=32))
    argv = ["--model", moe, "--dataset", os.path.join(ROOT, "megatron_grpo/data/builtin/"
                                                      "arithmetic.jsonl"),
            "--reward_funcs", "accuracy", "--tensor_model_parallel_size", "4",
            "--sequence_parallel", "true", "--expert_model_parallel_size", "4",
            "--pipeline_model_parallel_size", "2", "--num_generations", "4",
            "--global_batch_size", "8", "--micro_batch_size", "1"]
    cfg, problems = build_config(argv, 8)
    assert cfg.parallel.expert_tensor_parallel_size == 1
    assert not [m for m in problems.messages if "not divisible" in m], problems.messages
    _, problems = build_config(argv + ["--expert_tensor_parallel_size", "4"], 8)
    assert any("world size 8 is not divisible by --expert_tensor_parallel_size 4" in m
               for m in problems.messages), problems.messages


def test_torch_dtype_chooses_the_training_dtype_as_in_ms_swift(model_dir, caplog):
    """--torch_dtype (in ms-swift's GRPO commands): bfloat16 and float16 train in bf16 (a
    float16 run with a warning: fp16 training is not supported), float32 in float32; a
    --bf16 that says otherwise is an error naming both."""
    for dtype, bf16 in (("bfloat16", True), ("float32", False)):
        assert parse_rlhf_args(args(model_dir, "--torch_dtype", dtype)).training.bf16 is bf16
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.config"):
        assert parse_rlhf_args(args(model_dir, "--torch_dtype", "float16")).training.bf16 is True
    assert any("--torch_dtype float16" in r.message for r in caplog.records)
    assert "--torch_dtype float32 and --bf16 true disagree" in error_of(
        args(model_dir, "--torch_dtype", "float32", "--bf16", "true"))
    assert parse_rlhf_args(args(model_dir, "--torch_dtype", "float32", "--bf16", "false"))
