"""Our defaults against ms-swift's (config/swift_defaults.py): every flag we share with
ms-swift defaults to ms-swift's value, declared or computed, unless DIFFERENCES says why not;
the dry run names the differences a command line relies on."""
import json
import os

import pytest

from megatron_grpo.config import ALIASES, GROUPS, Problems, parse_rlhf_args
from megatron_grpo.config import swift_defaults as sd
from megatron_grpo.config import swift_flags as sf
from megatron_grpo.config.parse import collect_values, field_table

from tests.test_config_validate import args, model_dir  # noqa: F401  (fixture)

TABLE = field_table(GROUPS)


def _ours_declared(name):
    return TABLE[ALIASES.get(name, name)].default


def test_the_table_holds_every_flag_shared_with_ms_swift():
    current = {n for names in sf.MS_SWIFT_FLAGS.values() for n in names}
    shared = {n for n in current if ALIASES.get(n, n) in TABLE}
    assert set(sd.MS_SWIFT_DEFAULTS) == shared
    assert set(sd.RULES) <= shared and set(sd.DIFFERENCES) <= shared


def test_declared_defaults_are_ms_swifts():
    """A default that is not ms-swift's declared one is computed (RULES) or differs on
    purpose (DIFFERENCES); an entry of those that no longer differs is stale."""
    differ = {n for n, v in sd.MS_SWIFT_DEFAULTS.items() if _ours_declared(n) != v}
    assert differ <= set(sd.RULES) | set(sd.DIFFERENCES), differ - set(sd.RULES)
    stale = [n for n in sd.DIFFERENCES if n not in differ and n not in sd.RULES]
    assert not stale, stale


SCRIPTS = {
    "full": [],
    "lora": ["--tuner_type", "lora"],
    "lora-lr": ["--tuner_type", "lora", "--lr", "3e-5", "--merge_lora", "false"],
    "rloo": ["--advantage_estimator", "rloo", "--loss_type", "dapo"],
    "real": ["--loss_type", "real", "--micro_batch_size", "8"],
    "server": ["--vllm_mode", "server", "--train_iters", "3"],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_resolved_defaults_are_ms_swifts(model_dir, script):
    """The finalized value of every shared option (computed defaults resolved) equals
    ms-swift's for the same command line, except the DIFFERENCES."""
    argv = args(model_dir, *SCRIPTS[script])
    given = set(collect_values(argv, GROUPS, Problems()))
    cfg = parse_rlhf_args(argv)
    unset = [n for n in sd.MS_SWIFT_DEFAULTS if ALIASES.get(n, n) not in given]
    differ = {n: (sd._ours(cfg, n), sd.ms_swift_value(n, cfg)) for n in unset
              if n not in sd.DIFFERENCES and sd._ours(cfg, n) != sd.ms_swift_value(n, cfg)}
    assert not differ, differ


def test_lr_and_merge_lora_follow_ms_swifts_rules(model_dir):
    full = parse_rlhf_args(args(model_dir))
    assert (full.training.lr, full.training.merge_lora) == (1e-5, None)
    lora = parse_rlhf_args(args(model_dir, "--tuner_type", "lora"))
    assert (lora.training.lr, lora.training.merge_lora) == (1e-4, True)
    kept = parse_rlhf_args(args(model_dir, "--tuner_type", "lora", "--merge_lora", "false",
                                "--lr", "2e-5"))
    assert (kept.training.lr, kept.training.merge_lora) == (2e-5, False)
    assert (full.logging.wandb_project, full.logging.swanlab_project) == ("megatron-swift",) * 2


def _differing(argv):
    given = collect_values(argv, GROUPS, Problems())
    return sd.differing_defaults(parse_rlhf_args(argv), given)


def test_the_dry_run_names_the_differences_a_command_line_relies_on(model_dir):
    lines = {line.split()[0]: line for line in _differing(args(model_dir))}
    want = {"--rlhf_type", "--num_train_epochs", "--attention_backend", "--padding_free",
            "--output_dir", "--vllm_mode"}
    assert set(lines) - {"--report_to"} == want, lines    # report_to: without tensorboard
    assert lines["--padding_free"] == ("--padding_free ours false, ms-swift true (" +
                                       sd.DIFFERENCES["padding_free"][1] + ")")
    assert lines["--output_dir"].startswith("--output_dir ours megatron_output/model, ms-swift "
                                            "megatron_output/model/v<N>-<date>-<time> (")
    assert lines["--num_train_epochs"].startswith("--num_train_epochs ours 3.0, ms-swift unset")
    # Passed (flags or --config), or without effect on the run: not listed.
    passed = args(model_dir, "--rlhf_type", "grpo", "--attention_backend", "auto",
                  "--padding_free", "false", "--output_dir", "out", "--vllm_mode", "colocate",
                  "--report_to", "none", "--train_iters", "2", "--tuner_type", "lora")
    assert _differing(passed) == []
    rloo = _differing(args(model_dir, "--advantage_estimator", "rloo", "--train_iters", "1"))
    assert "--scale_rewards ours none, ms-swift group (" in "\n".join(rloo)
    assert "--kl_in_reward ours true, ms-swift false (" in "\n".join(rloo)
    assert "--num_train_epochs" not in "\n".join(rloo)      # --train_iters given
    server = _differing(args(model_dir, "--vllm_mode", "server", "--train_iters", "1"))
    assert "--vllm_server_host ours 127.0.0.1, ms-swift unset (" in "\n".join(server)
    # A float16 checkpoint trains in bf16 here, in fp16 in ms-swift.
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "torch_dtype": "float16"}, f)
    assert "--bf16 ours true, ms-swift false (--fp16 true) (fp16 training is not supported" \
        in "\n".join(_differing(args(model_dir)))
    block = sd.format_differing_defaults(parse_rlhf_args(args(model_dir)), set())
    assert block.startswith("defaults that differ from ms-swift's (flags not passed):\n  --")
