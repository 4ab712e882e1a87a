"""Every ms-swift Megatron GRPO flag is an option of ours or rejected with its feature."""
import os

import pytest

from megatron_grpo.config import ALIASES, GROUPS, ConfigError, parse_rlhf_args
from megatron_grpo.config import swift_flags as sf
from megatron_grpo.config.parse import field_table

from tests.test_config_validate import ROOT, args, error_of, model_dir  # noqa: F401  (fixture)

PLUGIN = os.path.join(ROOT, "examples", "plugins", "digits_reward.py")
OURS = set(field_table(GROUPS)) | set(ALIASES)


def test_every_ms_swift_flag_is_accounted_for():
    flags = sf.all_flags()
    assert len(flags) > 400
    missing = [f for f in flags if f not in OURS and f not in sf.FEATURE_OF and f not in sf.TO_WIRE]
    assert not missing, f"ms-swift flags neither implemented nor rejected: {missing}"


def test_tables_name_only_ms_swift_flags_and_no_implemented_one():
    flags = set(sf.all_flags())
    assert set(sf.FEATURE_OF) <= flags, set(sf.FEATURE_OF) - flags
    assert set(sf.ACCEPTED_WITHOUT_EFFECT) <= set(field_table(GROUPS))
    # A rejected flag that is also an option would never be rejected: one of them is stale.
    # (OTHER_BRANCH entries become options when that branch is merged: then drop them.)
    stale = {f for f in sf.FEATURE_OF if f in OURS and f not in sf.OTHER_BRANCH}
    assert not stale, stale
    for name, value in sf.UNSUPPORTED_VALUES:
        assert name in OURS


@pytest.mark.parametrize("flag, feature", [
    ("moe_enable_deepep", "MoE kernels and router variants (DeepEP, shared-expert overlap, "
                           "expert bias)"),
    ("lora_bias", "LoRA variants (mcore adapters, target_regex, LoRA bias and dtype, tuner "
                  "backends)"),
    ("agent_template", "agent templates (multi-turn rollouts use the chat template)"),
    ("vit_lr", "vision-language tuning options (ViT learning rate and recompute, mrope "
               "overrides, bbox normalisation)"),
    ("packing", "packing samples into fixed-length bins across the dataset (--padding_free "
                "true packs each micro-batch)"), ("fp8_format", "fp8/fp4 training"),
    ("metric_for_best_model", "best-checkpoint selection and validation perplexity "
                              "(evaluation logs eval/* rewards)")])
def test_unsupported_flag_one_line(model_dir, flag, feature):
    message = error_of(args(model_dir, f"--{flag}", "true"))
    assert message == f"--{flag} is an ms-swift option not supported yet: {feature}"


def test_unsupported_flags_collected_with_others(model_dir):
    message = error_of(args(model_dir, "--mlp_padding_free", "true", "--fp8_format", "e4m3",
                            "--lerning_rate", "1e-6", "--epsilon", "x"))
    assert message.startswith("4 problems")
    assert "--mlp_padding_free is an ms-swift option not supported yet: padding-free MLP" in message
    assert "--fp8_format is an ms-swift option not supported yet: fp8/fp4 training" in message
    assert "Did you mean: --learning_rate" in message and "--epsilon 'x'" in message


def test_unsupported_value(model_dir):
    message = error_of(args(model_dir, "--lr_decay_style", "WSD"))
    assert message.startswith("--lr_decay_style 'WSD' is an ms-swift value not supported yet: learning-rate")


def test_yaml_key_rejected_too(model_dir, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("moe_enable_deepep: true\n")
    message = error_of(args(model_dir, "--config", str(path)))
    assert message == "--moe_enable_deepep is an ms-swift option not supported yet: MoE kernels and router variants (DeepEP, shared-expert overlap, expert bias)"


def test_accepted_options(model_dir):
    cfg = parse_rlhf_args(args(model_dir, "--save_safetensors", "true", "--load_safetensors", "true",
                               "--dataset_num_proc", "8", "--dataloader_num_workers", "8",
                               "--load_from_cache_file", "true", "--wandb_project", "p",
                               "--wandb_exp_name", "e", "--enable_thinking", "false",
                               "--custom_register_path", PLUGIN, "--attention_backend", "auto"))
    assert cfg.data.dataset_num_proc == 8 and cfg.data.enable_thinking is False
    assert cfg.logging.wandb_project == "p" and cfg.logging.wandb_exp_name == "e"
    assert cfg.reward.external_plugins == [PLUGIN]


@pytest.mark.parametrize("extra, expected", [
    (["--save_safetensors", "false"], "--save_safetensors false"),
    (["--load_safetensors", "false"], "--load_safetensors false"),
    (["--recompute_granularity", "full"], "--recompute_method uniform|block"),
    (["--recompute_granularity", "full", "--recompute_method", "uniform",
      "--recompute_num_layers", "0"], "--recompute_num_layers 0 must be >= 1"),
    (["--recompute_num_layers", "2"], "applies to --recompute_granularity full only"),
    (["--recompute_modules", "moe_layer"], "--recompute_modules 'moe_layer' is not a valid choice"),
    (["--recompute_modules", "moe"], "--recompute_modules moe recomputes part of a "
                                     "mixture-of-experts layer"),   # model_dir is dense
    (["--attention_backend", "sdpa"], "--attention_backend 'sdpa' is not a valid choice"),
    (["--dataset_num_proc", "0"], "--dataset_num_proc 0"),
])
def test_option_errors(model_dir, extra, expected):
    assert expected in error_of(args(model_dir, *extra))


def test_flash_attention_without_transformer_engine(model_dir):
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed")
    message = error_of(args(model_dir, "--attention_backend", "flash"))
    assert message.startswith("--attention_backend flash needs Transformer Engine (GPU)")


def test_recompute_full_accepted(model_dir):
    cfg = parse_rlhf_args(args(model_dir, "--recompute_granularity", "full", "--recompute_method",
                               "block", "--recompute_num_layers", "1"))
    assert (cfg.training.recompute_granularity, cfg.training.recompute_method,
            cfg.training.recompute_num_layers) == ("full", "block", 1)


def test_checkpoint_flags(model_dir, tmp_path):
    """--no_save_optim / --no_save_rng (bare or with a value) and --finetune, which needs a
    checkpoint to load: without --resume it does nothing (ms-swift scripts pass it by
    default), with --resume auto it is refused."""
    cfg = parse_rlhf_args(args(model_dir, "--no_save_optim", "--no_save_rng", "true"))
    assert cfg.logging.no_save_optim is True and cfg.logging.no_save_rng is True
    plain = parse_rlhf_args(args(model_dir))
    assert not (plain.logging.no_save_optim or plain.logging.no_save_rng or plain.logging.finetune)
    assert parse_rlhf_args(args(model_dir, "--finetune", "true")).logging.finetune is False
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "checkpoint.json").write_text("{}")      # a complete checkpoint's mark
    cfg = parse_rlhf_args(args(model_dir, "--finetune", "true", "--resume", str(ckpt)))
    assert cfg.logging.finetune is True and cfg.logging.resume == str(ckpt)
    message = error_of(args(model_dir, "--finetune", "true", "--resume", "auto"))
    assert message.startswith("--finetune true with --resume auto") and "--resume PATH" in message


def test_false_of_a_flag_for_what_runs_here_is_accepted(model_dir, tmp_path):
    """ms-swift scripts spell out fusions and offloads as false (real.sh:
    --gradient_accumulation_fusion false): accepted, on the command line and in YAML, as
    what runs here; true is refused naming the false that is accepted."""
    assert set(sf.OFF_HERE) <= set(sf.FEATURE_OF)
    path = tmp_path / "run.yaml"
    path.write_text("masked_softmax_fusion: false\noptimizer_cpu_offload: false\n")
    cfg = parse_rlhf_args(args(model_dir, "--gradient_accumulation_fusion", "false",
                               "--apply-rope-fusion=false", "--manual_gc", "0",
                               "--check_model", "false",   # the Ascend lora script's
                               # ms-swift's Megatron GRPO refuses their true itself
                               "--async_generate", "false", "--sync_ref_model", "false",
                               "--add_version", "false",   # output_dir is used as given
                               "--config", str(path), "--lr", "2e-6"))
    assert cfg.training.lr == 2e-6
    message = error_of(args(model_dir, "--gradient_accumulation_fusion", "true",
                            "--use_precision_aware_optimizer"))
    assert message.startswith("2 problems")
    for flag, feature in (("gradient_accumulation_fusion", "Megatron kernel fusions (GPU)"),
                          ("use_precision_aware_optimizer", "optimizer CPU offload")):
        assert f"--{flag} is an ms-swift option not supported yet: {feature}" in message
        assert f"--{flag} false (what runs here) is accepted" in message


def test_what_the_accepted_false_flags_name_is_off_here():
    """The Megatron settings behind OFF_HERE are off in the model and optimizer configs
    this project builds (the optimizer's: Megatron's defaults, which setup leaves)."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    from megatron_grpo.model import build_transformer_config
    from tests.mcore_utils import TINY_QWEN2

    config, _ = build_transformer_config(TINY_QWEN2, tp=1)
    optimizer = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    checked = 0
    for name in sf.OFF_HERE:
        if hasattr(config, name):
            assert getattr(config, name) is False, name
            checked += 1
        elif name in optimizer:
            assert optimizer[name] is False, name
            checked += 1
    assert checked == 9
