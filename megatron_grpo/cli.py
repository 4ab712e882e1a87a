"""The `megatron` command: `rlhf`, `rollout` and `export` subcommands.

    megatron rlhf --rlhf_type grpo --model DIR --dataset data.jsonl ...   # train
    megatron rollout --model DIR --port 8000                               # vLLM server
    megatron export --to_mcore true --model DIR --output_dir OUT ...       # convert

Configuration errors are reported before torch, Megatron or vLLM are imported and
before any process is launched: every problem of the command line in one message
(unknown flags with a suggestion each, then invalid values), one line per problem.
"""
from __future__ import annotations

import gc
import os
import sys
import warnings

from . import console, launch

USAGE = """usage: megatron <command> [options]

commands:
  rlhf      GRPO training on Megatron-Core with vLLM rollouts (megatron rlhf --rlhf_type grpo ...)
  rollout   start a vLLM rollout server for --vllm_mode server
  export    convert checkpoints: --to_mcore true (HF -> Megatron) or --to_hf true (Megatron -> HF)

Multi-process runs: NPROC_PER_NODE=N (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for
several nodes, which go through torchrun) re-launch the command as N workers, as in ms-swift.
Run `megatron <command> --help` for the options of a command.
"""
# Function-level imports: each command imports only what it needs, when it needs it, so that
# `--help` and option errors come before torch, Megatron and vLLM are imported.


def _rlhf(argv: list[str]) -> int:
    from .config import build_config, rlhf_help

    if "-h" in argv or "--help" in argv:
        print(rlhf_help())
        return 0
    argv, nproc = launch.pop_nproc_flag(argv)
    if launch.in_torchrun():     # a worker of a quiet launcher: its output to its own log
        console.quiet_worker(int(os.environ.get("RANK", "0")))
    world_size, env_problem = None, None
    try:
        spec = launch.launch_spec(nproc)
        world_size = launch.current_world_size(spec)
    except ValueError as e:
        env_problem = str(e)
    cfg, problems = build_config(argv, world_size)   # parser + option + world checks, no torch
    if env_problem:
        problems.add(env_problem)
    dataset = val_dataset = None
    if (not launch.in_torchrun() or cfg.training.dry_run) and \
            not problems.names_any(("dataset", "columns", "system", "val_dataset",
                                    "split_dataset_ratio")):
        # Read the datasets once here, so that a file without a prompt column fails now,
        # not after every rank has built its model.
        from .data import load_datasets

        with problems.section():
            dataset, val_dataset = load_datasets(cfg.data, cfg.evaluation, seed=cfg.training.seed)
        if dataset is not None and cfg.model.teacher_model_server is not None and \
                not problems.names_any(("teacher_model_server",)):
            from .config.validate import route_rows, teacher_servers

            with problems.section():      # every prompt has its teacher
                servers = teacher_servers(cfg.model.teacher_model_server)
                for d in (dataset, val_dataset):
                    if d is not None:
                        route_rows(servers, d, cfg.model.teacher_tag_key)
    if dataset is not None and dataset.images is not None and not problems:
        _check_image_prompts(cfg, dataset, val_dataset, problems)
    if cfg.training.dry_run and not problems:
        return _dry_run(cfg, spec, dataset, val_dataset, problems, argv)
    problems.raise_if_any()
    plan = None
    if not launch.in_torchrun():
        plan = _check_memory(cfg, spec, dataset)
        spec = launch.fresh_port(spec)   # picked free again: the plan took a while
    _route_output(cfg, spec)
    if spec.world_size > 1 and not launch.in_torchrun():
        code = launch.relaunch("rlhf", argv, spec, preload=lambda: _import_rank_modules(cfg),
                               fork_main=main, plan=plan)
        if "megatron.core" in sys.modules:
            # The workers were forks of this process, which imported their modules first
            # (launch.fork_workers): no teardown of them here either (see _exit_worker).
            _exit_worker(code)
        return code
    if launch.in_torchrun():
        # Start-up makes ~680,000 objects that live as long as the process (the modules of
        # torch, Megatron and vLLM, the models), and the cyclic collector's passes over them
        # free nothing: ~2 CPU s per rank of the ~10 before the first rollout (quickstart,
        # docs/benchmarks.md). Off until the run is built (trainer.train).
        gc.disable()
    from .platform.compat.megatron import import_core

    import_core(hide=() if "wandb" in (cfg.logging.report_to or ()) else ("wandb",))
    from .trainer import train

    worker = launch.in_torchrun()
    # A worker ends with os._exit right after (_exit_worker): vLLM's engine teardown (a
    # gc pass over the whole heap, its process groups; ~1 CPU s per rank, measured with
    # tools/profile_startup.py) would free nothing that the exit does not. The run stays
    # referenced until then: releasing it (models, vLLM engine) took ~2 s in a worker
    # forked by the launcher (measured at the quickstart's end; docs/benchmarks.md).
    try:
        run = train(cfg, close_engine=not worker)
    except ValueError as e:
        # Past the checks, a ValueError is a failure of the run (from torch, vLLM, a reward
        # plugin ...), not a bad option: its traceback, and exit code 1.
        raise RunFailed(f"the run failed: {e}") from e
    if worker:
        _exit_worker()
    del run
    return 0


def _check_image_prompts(cfg, dataset, val_dataset, problems) -> None:
    """Each image of a row has its placeholder in the prompt the model's chat template
    renders (data/vision.py), checked before any engine starts: vLLM would fail on it only
    once the models are loaded."""
    from .data.vision import VisionProcessor, is_vision_language

    if not is_vision_language(cfg.model.model):
        return                  # the trainer refuses images for a text model (train/run.py)
    with problems.section():
        vision = VisionProcessor(cfg.model.model, cfg.data.max_pixels)
        vision.check_placeholders(dataset, "--dataset")
        vision.check_placeholders(val_dataset, "--val_dataset")


def _route_output(cfg, spec) -> None:
    """Where the run's output goes (--log_level): the libraries' to OUTPUT_DIR/logs/, the
    user's (plan, progress, warnings, result) to the console; the launcher says so once.
    A worker of a quiet launcher moved its output already (quiet_worker) and now shows
    the package's warnings; one started by torchrun (several nodes) moves its own."""
    level = cfg.logging.log_level
    if level == "debug":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG")
    if level not in ("warning", "error"):
        return
    logs = os.path.join(cfg.logging.output_dir, "logs")
    if launch.in_torchrun():
        rank = int(os.environ.get("RANK", "0"))
        if console.log_path() is None:
            console.quiet(os.path.join(logs, f"rank-{rank}.log"), level)
        else:
            console.route_package_logs(level)
        return
    if spec.nnodes > 1:
        return            # torchrun's workers: each moves its own output (above)
    console.quiet(os.path.join(logs, "launcher.log" if spec.world_size > 1 else "rank-0.log"),
                  level)
    note = (" (on a CPU they note the GPU kernels they fall back from: harmless)"
            if _memory_device() == "cpu" else "")
    console.say(f"[megatron] output in {cfg.logging.output_dir}; the libraries' messages in "
                f"{logs}/{note}")
    _say_preloaded()


def _say_preloaded() -> None:
    """The plan's line for what the launcher preloaded (preload.py), if anything."""
    from .preload import PRELOAD_ENV, preloaded

    if preloaded():
        console.say(f"[megatron] preloaded {preloaded()} ({PRELOAD_ENV}=1, vLLM's advice "
                    "for CPUs)")


def _memory_device() -> str:
    """Where the model will live, without importing torch: "cuda" for a GPU build of torch
    on a machine with an NVIDIA driver, else "cpu"."""
    builds = launch.torch_accelerator_builds() or []
    return "cuda" if "cuda" in builds and os.path.exists("/proc/driver/nvidia") else "cpu"


def _check_memory(cfg, spec, dataset) -> dict:
    """The memory plan: its short form printed, refused (ValueError naming the options
    that lower it) when this machine has too little; what the launcher keeps of it."""
    from .memory.plan import plan_for_launch, short_format, summary

    plan, available = plan_for_launch(cfg, dataset, spec.world_size, spec.nproc_per_node,
                                      device=_memory_device())
    print(short_format(plan, available), flush=True)
    if cfg.training.check_memory:
        plan.check(available)
    out = summary(plan, available)
    out["output_dir"] = cfg.logging.output_dir
    return out


def _import_rank_modules(cfg) -> None:
    """What a rank of this run imports before its first step, for a launcher that forks its
    workers (launch.fork_workers) to import once: Megatron (as the rank does: wandb hidden
    unless reported to), the trainer, transformers and, for a colocated engine, vLLM's LLM
    (its version checked first, as the engine does). Together ~8 of a rank's ~10 CPU s
    before its first rollout on the quickstart (tools/profile_startup.py)."""
    from .platform.compat.megatron import import_core

    import_core(hide=() if "wandb" in (cfg.logging.report_to or ()) else ("wandb",))
    import transformers  # noqa: F401
    from . import trainer  # noqa: F401

    if cfg.rollout.vllm_mode != "server":
        from .platform.compat import vllm as vllm_compat

        vllm_compat.check_version()
        from vllm import LLM  # noqa: F401


def _exit_worker(code: int = 0) -> None:
    """End a torchrun worker whose run has finished (or a launcher whose forked workers
    have), with `code`, without the interpreter's teardown.

    By then everything is on disk (checkpoints and final_hf/ written and renamed,
    metrics flushed, the logger and the vLLM engine closed). What is left is the
    interpreter's teardown of torch, Megatron, vLLM and their threads: 4-6 s here for
    nothing (measured: rc 6 s after the last atexit handler started, 0.6 s with this),
    at the end of every run. Children (a multiprocessing Manager, writer processes) are
    stopped first so that none outlives the run."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _dry_run(cfg, spec, dataset, val_dataset, problems, argv) -> int:
    """The checks that need the model's config (torch, Megatron's config class; no model is
    built, no process started), then the plan and the defaults the command line (`argv`)
    relies on where they are not ms-swift's."""
    from .config import GROUPS, Problems, validate_world
    from .config.dry_run import check_model, format_plan
    from .config.parse import collect_values
    from .config.swift_defaults import format_differing_defaults

    model = None
    with problems.section(), warnings.catch_warnings():
        warnings.simplefilter("ignore")       # Megatron's import-time notes (no TE/Apex ...)
        model = check_model(cfg)
    problems.raise_if_any()
    plan = validate_world(cfg, spec.world_size)
    print(format_plan(cfg, plan, model, nproc_per_node=spec.nproc_per_node, nnodes=spec.nnodes,
                      num_prompts=len(dataset), num_files=len(cfg.data.dataset),
                      reward_columns=sorted(dataset.columns),
                      num_val_prompts=len(val_dataset) if val_dataset is not None else None))
    differing = format_differing_defaults(cfg, collect_values(argv, GROUPS, Problems()))
    if differing:
        print(differing)
    from .memory.plan import plan_for_launch

    memory, available = plan_for_launch(cfg, dataset, spec.world_size, spec.nproc_per_node,
                                        device=_memory_device())
    print(memory.format(available))
    _say_preloaded()
    if cfg.training.check_memory:
        memory.check(available)
    return 0


def _export(argv: list[str]) -> int:
    argv, nproc = launch.pop_nproc_flag(argv)
    spec = launch.launch_spec(nproc)
    from .config.export import parse_export_args

    parse_export_args(argv)   # --help and option errors before torch and Megatron are imported
    from . import convert

    convert.check_args(argv, launch.current_world_size(spec))   # fail before launching
    if spec.world_size > 1 and not launch.in_torchrun():
        return launch.relaunch("export", argv, spec)
    return convert.main(argv) or 0


def _rollout(argv: list[str]) -> int:
    from .config import parse_rollout_args

    parse_rollout_args(argv)      # --help and option errors before torch and vLLM are imported
    from .rollout import server

    return server.main(argv) or 0


class RunFailed(RuntimeError):
    """A run that passed its checks failed; raised from the error that ended it, so that
    the traceback shows where (not the one-line message of an option error)."""


COMMANDS = {"rlhf": _rlhf, "rollout": _rollout, "export": _export}


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"megatron: unknown command {command!r}; valid commands: "
              f"{', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    if command in ("rlhf", "rollout") and not launch.in_torchrun() and \
            not {"-h", "--help"} & set(rest):
        from .preload import reexec_with_preload

        reexec_with_preload(argv, cpu_build=launch.torch_accelerator_builds() == [])
    try:
        return COMMANDS[command](rest)
    except ValueError as e:
        # User errors: one line per problem, no traceback.
        print(f"megatron {command}: error: {e}", file=console.err(), flush=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()       # a reader that left shows up here at the latest
    except BrokenPipeError:
        # `megatron rlhf --help | head`: the reader has all it wanted. Point stdout at
        # /dev/null so that the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
