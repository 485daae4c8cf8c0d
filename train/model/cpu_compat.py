"""Run megatron-core 0.16 under gloo on a machine without CUDA (tests, laptops, CI).

megatron-core hard-codes CUDA in a few places (see ../shared/notes/megatron-cpu.md): `device="cuda"`
literals and `torch.cuda.current_device()` in the pipeline schedules, grad buffers, grad clipping and
dist_checkpointing; `Tensor.cuda()` in the language module; type-string checks such as
`param.type() == "torch.cuda.FloatTensor"` in the optimizers; and a CUDA-only RNG tracker. `install()`
makes all of these work on CPU, and does nothing when CUDA is available:

- a `TorchFunctionMode` that maps CUDA devices (``"cuda"``, ``"cuda:N"``, bare ints) to CPU in every
  torch call, makes `Tensor.cuda()` return the tensor itself and reports `torch.cuda.*` type strings
  for CPU tensors (so megatron's "is this a CUDA float tensor" checks take the normal path);
- stubs for `torch.cuda.current_device / synchronize / set_device / device_count` (device count 1 so
  `rank % device_count()` does not divide by zero), and no-op `torch.cuda.Stream / Event / current_stream /
  stream` (the MoE alltoall token dispatcher's side stream for its device-to-host copies), and that
  dispatcher's host copies of its split sizes made numpy arrays on CPU too, and the backward of megatron's
  collective autograd functions (tensor_parallel.mappings: the expert all-to-all, gathers) run under the
  mode (`_patch_moe`);
- `CPURNGStatesTracker`, megatron's tracker with the same names and seed offsets
  (`seed` data-parallel, `seed + 2718 + tp_rank` model-parallel, `seed + 1024 + ...` expert) whose
  states are CPU generator states, so tensor-parallel regions still draw different numbers per TP rank;
- `TORCHDYNAMO_DISABLE=1` (unless set) and megatron imported with `torch.compile` the identity
  (`import_megatron`): its import-time wrappers then skip importing dynamo and inductor; no compiled
  function runs on our CPU path;
- megatron's activation-recompute functions (`CheckpointFunction`, `CheckpointWithoutOutputFunction`)
  re-enter the mode in their backward, where they rerun forward code: autograd's backward runs inside
  the mode's handler for `backward`, i.e. with the mode off the stack.

The mode is entered globally (a process-wide mode stack entry) and must be installed at import time
of the entry module: dist_checkpointing's async writer starts processes with `spawn`, which re-import
`__main__` only, not the trainer's setup code. Its overhead measured within noise on the tiny model's
training step; `suspended()` turns it off around code that needs none of it (generation).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: TorchFunctionMode | None = None
_SAVED_CUDA: dict = {}
_SAVED_RNG: dict = {}
_SAVED_MOE: dict = {}

# CPU tensor type string -> the CUDA one megatron compares against.
_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CPU_TYPE = {v: k for k, v in _CUDA_TYPE.items()}


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # A bare int is a CUDA ordinal for torch (what torch.cuda.current_device() returns).
    return isinstance(dev, int) and not isinstance(dev, bool)


def _map_device(dev: Any) -> Any:
    return torch.device("cpu") if _is_cuda_device(dev) else dev


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU; `Tensor.cuda()` is the identity; CUDA type strings."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # Keep dtype/non_blocking semantics trivial: the tensor already lives on the only device.
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE.get(name, name)
            target = args[1] if len(args) > 1 else kwargs.get("dtype")
            if isinstance(target, str) and target in _CPU_TYPE:
                return func(args[0], _CPU_TYPE[target], *args[2:], **{k: v for k, v in kwargs.items()
                                                                       if k != "dtype"})
            return func(*args, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros) and len(args) > 1:
            args = (args[0],) + tuple(_map_device(a) if isinstance(a, (str, torch.device)) else a
                                      for a in args[1:])
            if func is torch.Tensor.to:
                # `t.to(0)` means cuda:0; ints are never a dtype here.
                args = tuple(torch.device("cpu") if i > 0 and isinstance(a, int) and not isinstance(a, bool)
                             else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class CPURNGStatesTracker:
    """megatron's `CudaRNGStatesTracker` interface over CPU generator states.

    `add(name, seed)` stores the state of a CPU generator seeded with `seed`; `fork(name)` swaps it
    into the default CPU generator for the duration of the block and saves the advanced state back,
    exactly as the CUDA tracker does with the CUDA generator.
    """

    def __init__(self, *args, **kwargs):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = kwargs.get("is_inference_rng_tracker", False)
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    for name in ("CudaRNGStatesTracker", "_get_cuda_rng_state", "_set_cuda_rng_state"):
        _SAVED_RNG[name] = getattr(mrandom, name)
    # Replace the class megatron instantiates and checks with isinstance (get_all_rng_states).
    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
    # Activation recomputation saves/restores "CUDA" states through these two helpers.
    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
            mrandom._CUDA_RNG_STATE_TRACKER, CPURNGStatesTracker):
        mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recompute reruns forward code (e.g. the causal mask's device="cuda") inside autograd's
    # backward pass, where this mode is off the stack: its handler for `backward` pops it while the whole
    # backward runs. Megatron's checkpoint functions re-enter it for their recompute.
    for cls in (mrandom.CheckpointFunction, mrandom.CheckpointWithoutOutputFunction):
        _SAVED_RNG[cls] = cls.__dict__["backward"]
        cls.backward = staticmethod(_under_mode(cls.__dict__["backward"].__func__))


def _under_mode(backward):
    def wrapped(ctx, *grads):
        if _MODE is None or _MODE in torch.overrides._get_current_function_mode_stack():
            return backward(ctx, *grads)
        with _MODE:
            return backward(ctx, *grads)
    return wrapped


class CPUEvent:
    """A `torch.cuda.Event` stand-in: on CPU every operation has finished when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUStream:
    """A `torch.cuda.Stream` stand-in (megatron's alltoall MoE token dispatcher makes a side stream for its
    device-to-host copies of the token counts, and waits on it): CPU work is in order, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> CPUEvent:
        return event or CPUEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = CPUStream()


def _patch_cuda_module() -> None:
    cuda = torch.cuda
    for name in ("current_device", "synchronize", "set_device", "device_count", "get_rng_state",
                 "set_rng_state", "memory_allocated", "max_memory_allocated", "memory_reserved",
                 "empty_cache", "Stream", "Event", "current_stream", "stream"):
        _SAVED_CUDA[name] = getattr(cuda, name)
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 1
    # torch.cuda.manual_seed is lazy (queued) without CUDA; megatron calls it with the DP seed, which
    # on CPU is the default generator's job, so it is left alone.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.empty_cache = lambda: None
    cuda.Stream, cuda.Event = CPUStream, CPUEvent
    cuda.current_stream = lambda device=None: _CURRENT_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_moe() -> None:
    """megatron's alltoall MoE dispatcher copies its split sizes to the host as numpy arrays with
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on CPU the sizes stay
    tensors, which `all_to_all_single` refuses. Convert CPU tensors too."""
    from megatron.core.transformer.moe import token_dispatcher

    orig = token_dispatcher.maybe_move_tensor_to_cpu
    _SAVED_MOE["maybe_move_tensor_to_cpu"] = orig

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    # The expert-parallel collectives' autograd functions (all-to-all, gather / reduce-scatter) allocate their
    # backward outputs on torch.cuda.current_device(), in autograd's backward, where the mode is off the stack.
    from megatron.core.tensor_parallel import mappings

    for cls in vars(mappings).values():
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and "backward" in cls.__dict__:
            _SAVED_MOE[cls] = cls.__dict__["backward"]
            cls.backward = staticmethod(_under_mode(cls.__dict__["backward"].__func__))


@contextlib.contextmanager
def suspended():
    """The mode off for a block of plain CPU torch code in a process that has it on (transformers generation
    in the trainer's process: RL rollouts, in-loop generative evaluation), where its Python call per torch op
    is pure overhead (rollouts of the demo's GRPO stage: 0.19 s with it, 0.10 s without)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if _MODE is None or not stack or stack[-1] is not _MODE:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def active() -> bool:
    """True when the CPU compatibility layer is installed in this process."""
    return _INSTALLED


def install() -> bool:
    """Make megatron-core run on CPU/gloo. Idempotent; a no-op (returns False) when CUDA is available."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False
    import_megatron()
    _patch_cuda_module()
    _MODE = CudaToCpuMode()
    _MODE.__enter__()  # left entered for the life of the process
    _patch_rng()
    _patch_moe()
    _INSTALLED = True
    return True


def import_megatron() -> None:
    """Import megatron-core; without CUDA, with TORCHDYNAMO_DISABLE=1 (unless set) and `torch.compile` the
    identity while it imports. megatron wraps its fusion kernels in `torch.compile` at import time; with the
    fusions off (train.model.gpt) none of them runs on CPU, and a disabled compile runs the Python unchanged
    anyway, but torch 2.13's `torch.compile` imports dynamo and inductor before it looks at the variable
    (~0.7 s a process). megatron's `jit_fuser` keeps the identity for the modules it decorates later."""
    if "megatron.core" in sys.modules or torch.cuda.is_available():
        import megatron.core  # noqa: F401
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    compile_ = torch.compile
    if os.environ["TORCHDYNAMO_DISABLE"] == "1":
        torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda fn: fn)
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_


def uninstall() -> None:
    """Undo `install()` (for tests that must leave the process as they found it)."""
    global _INSTALLED, _MODE
    if not _INSTALLED:
        return
    _MODE.__exit__(None, None, None)
    _MODE = None
    for name, fn in _SAVED_CUDA.items():
        setattr(torch.cuda, name, fn)
    _SAVED_CUDA.clear()
    from megatron.core.tensor_parallel import random as mrandom

    for key, obj in _SAVED_RNG.items():
        if isinstance(key, type):  # a checkpoint Function class: its original backward
            key.backward = obj
        else:
            setattr(mrandom, key, obj)
    _SAVED_RNG.clear()
    from megatron.core.transformer.moe import token_dispatcher

    for key, fn in _SAVED_MOE.items():
        if isinstance(key, type):
            key.backward = fn
        else:
            setattr(token_dispatcher, key, fn)
    _SAVED_MOE.clear()
    mrandom.initialize_rng_tracker(force_reset=True)
    _INSTALLED = False
