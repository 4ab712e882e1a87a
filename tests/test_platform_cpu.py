"""platform.cpu.without_cuda_rewrite: the CUDA->CPU mode is off inside the block and back
afterwards, at its place on torch's mode stack, also after an exception.

The CPU layer is process-wide, so each probe runs in a fresh process (tests.harness).
Whether the mode is active is read from real behaviour: `device="cuda"` lands on the CPU
under the mode and fails without it (this machine has no CUDA).
"""
import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is CPU-only")


def _rewrites_cuda() -> bool:
    try:
        return torch.zeros(1, device="cuda").device.type == "cpu"
    except (RuntimeError, AssertionError):  # "Torch not compiled with CUDA enabled"
        return False


def _stack():
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


def _suspend_probe(rank, world):
    from megatron_grpo.platform import cpu

    # Not installed: a no-op (as on a GPU machine).
    with cpu.without_cuda_rewrite():
        assert not _rewrites_cuda()
    assert cpu.install()
    assert _rewrites_cuda()
    before = _stack()

    with cpu.without_cuda_rewrite():
        assert not _rewrites_cuda()
        assert not any(m is cpu._MODE for m in _stack())
        with cpu.without_cuda_rewrite():       # nested: still off, and no harm on exit
            assert not _rewrites_cuda()
        assert not _rewrites_cuda()
    assert _rewrites_cuda() and _stack() == before

    with pytest.raises(ValueError, match="inside"):
        with cpu.without_cuda_rewrite():
            raise ValueError("inside")
    assert _rewrites_cuda() and _stack() == before

    # A mode entered above ours stays active inside and keeps its place afterwards.
    with torch.device("meta"):
        outer = _stack()
        assert outer[-1] is not cpu._MODE and any(m is cpu._MODE for m in outer)
        with cpu.without_cuda_rewrite():
            assert torch.zeros(1).device.type == "meta"
            assert not _rewrites_cuda()
        assert _stack() == outer
        assert torch.zeros(1).device.type == "meta"
    assert _stack() == before and _rewrites_cuda()
    return True


def test_without_cuda_rewrite_suspends_and_restores():
    assert run_distributed(_suspend_probe, 1, fresh=True) == [True]  # needs a new process
