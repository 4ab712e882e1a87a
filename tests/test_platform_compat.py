"""platform/compat: the non-public vLLM / Megatron-Core names in one place per library.

- every name a compat module lists (PRIVATE_NAMES) resolves on the installed versions;
- no other module of the package spells a private vLLM / Megatron name, imports an
  internal vLLM module, sweeps sys.modules or tests a class by its name (the scan is
  itself checked on a snippet that does all of these);
- a version outside the verified range fails at first use with one message naming the
  escape hatch, and the escape hatch works.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import megatron_grpo
from megatron_grpo.platform import compat
from megatron_grpo.platform.compat import megatron as compat_megatron
from megatron_grpo.platform.compat import transformers as compat_transformers
from megatron_grpo.platform.compat import vllm as compat_vllm

PACKAGE = Path(megatron_grpo.__file__).parent
COMPAT_DIR = PACKAGE / "platform" / "compat"
# Modules whose internals are still to move into compat (none at the time of writing).
NOT_YET_MOVED: set = set()
PUBLIC_VLLM_MODULES = {"vllm", "vllm.platforms"}
# Instance attributes the compat modules wrap (see their comments).
PRIVATE_ATTRIBUTES = {"_already_called_process_weights_after_loading", "engine_core",
                      "cpu_linear", "call_utility_all_async", "chained_optimizers",
                      "expert_parallel_buffers", "is_stub_optimizer",
                      "model_param_group_index_map", "model_float16_groups",
                      "shard_fp32_from_float16_groups", "fp32_from_float16_groups"}

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")


def _private_leaves() -> set:
    names = set(PRIVATE_ATTRIBUTES)
    for entry in compat_vllm.PRIVATE_NAMES + compat_megatron.PRIVATE_NAMES + \
            compat_transformers.PRIVATE_NAMES:
        module, _, path = entry.partition(":")
        names.update(p for p in module.split(".") + path.split(".")
                     if p.startswith("_") and not p.startswith("__"))
    return names


def _is_type_name(node) -> bool:
    """`type(x).__name__`"""
    return isinstance(node, ast.Attribute) and node.attr == "__name__" and \
        isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "type"


def findings(source: str, private: set) -> list:
    """What the package may not do outside platform/compat, found in `source`."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree)
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        modules = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        for module, names in modules:
            if module.split(".")[0] == "vllm" and module not in PUBLIC_VLLM_MODULES:
                found.append(f"{line}: imports vLLM internals ({module})")
            if module.split(".")[0] == "megatron" and any(
                    p.startswith("_") for p in module.split(".") + names):
                found.append(f"{line}: imports a private Megatron name ({module})")
        words = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
            if node.attr in ("values", "items", "keys") and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "modules" and \
                    getattr(node.value.value, "id", None) == "sys":
                found.append(f"{line}: sweeps sys.modules")   # registering one module is fine
        elif isinstance(node, ast.alias):
            words = [node.name.rpartition(".")[2]]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docstrings:
            words = [node.value]
        found += [f"{line}: uses {w}" for w in words if w in private]
        if isinstance(node, ast.Compare) and \
                any(map(_is_type_name, [node.left, *node.comparators])):
            found.append(f"{line}: tests a class by its name")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and _is_type_name(node.func.value):
            found.append(f"{line}: tests a class by its name")
    return found


def test_scan_finds_each_kind_of_use():
    snippet = '''
"""Docstrings may name _layerwise_process."""
import sys
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
from vllm import LLM
from vllm.platforms import current_platform
mrandom._get_cuda_rng_state = None
hasattr(layer, "_already_called_process_weights_after_loading")
for mod in list(sys.modules.values()):
    sys.modules["plugin"] = mod
ok = type(method).__name__.startswith("Unquantized")
ok = type(method).__name__ in ("UnquantizedLinearMethod",)
llm.llm_engine.engine_core.shutdown()
'''
    found = findings(snippet, _private_leaves())
    assert not any(f.startswith("2:") for f in found), found   # docstrings may name them
    kinds = "\n".join(found)
    for expected in ("4: imports vLLM internals", "6: imports a private Megatron name",
                     "6: uses _ParamAndGradBuffer", "9: uses _get_cuda_rng_state",
                     "10: uses _already_called_process_weights_after_loading",
                     "11: sweeps sys.modules", "13: tests a class by its name",
                     "14: tests a class by its name", "15: uses engine_core"):
        assert expected in kinds, (expected, found)
    assert not any(f.startswith(("7:", "8:", "12:")) for f in found), found   # public API is fine


def test_no_private_vllm_or_megatron_name_outside_compat():
    private = _private_leaves()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if COMPAT_DIR in path.parents or str(rel) in NOT_YET_MOVED:
            continue
        problems += [f"megatron_grpo/{rel}:{f}" for f in findings(path.read_text(), private)]
    assert not problems, "move these into megatron_grpo/platform/compat/:\n" + "\n".join(problems)


def test_megatron_private_names_resolve():
    missing = []
    for name in compat_megatron.PRIVATE_NAMES:
        try:
            compat.resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing
    compat_megatron.check_version()     # the installed version is a verified one


def test_transformers_private_names_resolve():
    missing = []
    for name in compat_transformers.PRIVATE_NAMES:
        try:
            compat.resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing
    compat_transformers.check_version()


@needs_vllm
@pytest.mark.slow  # imports vLLM
def test_vllm_private_names_resolve():
    # vLLM's Qwen2.5-VL module imports only with torchvision, or with transformers' shim.
    compat_transformers.install_image_processor_shim()
    missing = []
    for name in compat_vllm.PRIVATE_NAMES:
        try:
            compat.resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing
    compat_vllm.check_version()
    assert compat_vllm.reload_helpers_present()


@pytest.mark.parametrize("module,version", [(compat_vllm, "0.33.0"), (compat_vllm, "0.31.2"),
                                            (compat_megatron, "0.20.0"),
                                            (compat_megatron, "0.15.3"),
                                            (compat_megatron, "dev")])
def test_unknown_version_fails_at_first_use_with_the_escape_hatch_named(monkeypatch, module,
                                                                         version):
    monkeypatch.setattr(module, "installed_version", lambda: version)
    monkeypatch.setattr(module, "_checked", False)
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    first_use = (compat_vllm.tp_rank_and_size if module is compat_vllm
                 else compat_megatron.rope_cp_slicing)
    with pytest.raises(compat.UntestedVersionError) as err:
        first_use()
    msg = str(err.value)
    assert version in msg and "MEGATRON_GRPO_ALLOW_UNTESTED=1" in msg
    assert f"compat/{module.__name__.rpartition('.')[2]}.py" in msg
    assert f">={'.'.join(map(str, module.LOWER))},<{'.'.join(map(str, module.UPPER))}" in msg
    assert not module._checked          # it fails again at the next use, not silently

    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="MEGATRON_GRPO_ALLOW_UNTESTED=1"):
        module.check_version()
    assert module._checked


def test_parse_version():
    assert compat.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert compat.parse_version("0.16.1rc2") == (0, 16, 1)
    assert compat.parse_version("1.2") == (1, 2)
    assert compat.parse_version("dev") == ()
    assert (0, 32) <= compat.parse_version("0.32.9") < (0, 33)
    assert not compat.parse_version("0.33.0") < (0, 33)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_import_core_hides_wandb_from_megatron_only():
    """compat.megatron.import_core: megatron.core imported without wandb (its optional
    imports see ImportError), and wandb importable again afterwards."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from megatron_grpo.platform.compat.megatron import import_core\n"
            "import_core()\n"
            "import megatron.core.timers as timers\n"
            "assert 'megatron.core' in sys.modules and 'wandb' not in sys.modules\n"
            "assert timers.wandb is None\n"
            "import wandb\n"
            "print('ok', wandb.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok wandb", r.stderr[-2000:]


@needs_vllm
@pytest.mark.slow  # imports vLLM
def test_engine_start_prepared_once_for_the_forks(monkeypatch):
    """compat.vllm.prepare_engine_start (the tests' preloads, before they fork): vLLM-CPU's
    worker module is imported and its Triton kernels point at the C++ fallbacks, and the
    platform's own registration at each engine start no longer sweeps sys.modules. The
    engines of the harness's ranks and of the CLI runs (forks of the tests' zygote) start
    after it (generation
    through the fallbacks: tests/test_rollout_colocate.py and the end-to-end runs)."""
    import sys

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM-CPU only")
    compat_vllm.prepare_engine_start()
    assert compat_vllm.CPU_WORKER_MODULE in sys.modules
    from vllm.triton_utils import HAS_TRITON, dispatcher

    if not HAS_TRITON:
        from vllm.v1.worker.block_table import ComputeSlotMappingKernel

        assert isinstance(ComputeSlotMappingKernel.kernel, dispatcher.KernelOverride)

    def sweep(*_):
        raise AssertionError("swept sys.modules again")

    monkeypatch.setattr(dispatcher, "_rebind_kernels", sweep)
    current_platform.register_triton_kernel_overrides()     # what each engine start calls
    compat_vllm.prepare_engine_start()                      # a second call: nothing
