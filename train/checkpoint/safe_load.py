"""Reading the pickled files of a checkpoint without running code from them.

A checkpoint may come from someone else: pulled from a shared bucket (`pull_newest` on resume), handed
over for `--init`, `train eval`, `ckpt merge` or `ckpt export`. A pickle can call any Python function
while it loads, on every rank that reads it, so no file of a checkpoint is read with plain `pickle`:

- `train_state.pt`, `rng/rankNNNNN.pt` (ours), megatron's `common.pt` and sharded objects (`*.pt`):
  `load_torch`, i.e. `torch.load(weights_only=True)`: tensors, numbers, strings, lists, tuples, dicts,
  plus numpy's array rebuild (RNG files written before they held tensors) and megatron-core's own
  allow-list (`megatron.core.safe_globals`: its config dataclasses and enums, `BytesIO`, ...).
- torch_dist checkpoints (a flattened distributed-optimizer state, or a Megatron-LM checkpoint read by
  `ckpt export`): torch.distributed.checkpoint reads `.metadata` with plain `pickle.load` and the bytes
  items of `*.distcp` files (megatron's sharded objects) with `torch.load(weights_only=False)`.
  `install()` replaces both, process-wide: `.metadata` goes through an unpickler that builds only the
  metadata's dataclasses and enums, torch dtypes, sizes and layouts; bytes items through `load_torch`.

Anything else is refused with `CheckpointError`, one line naming the file and the forbidden global.
`layout.verify` runs the same checks, so resume skips such a checkpoint like a corrupted one and
`train ckpt verify` reports it.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import re
from typing import BinaryIO

from train.checkpoint.errors import CheckpointError

# torch.distributed.checkpoint's metadata pickles dataclasses and enums of these modules (torch 2.13:
# Metadata, TensorStorageMetadata, ChunkStorageMetadata, BytesStorageMetadata, TensorProperties,
# MetadataIndex, StorageMeta, SavePlan, WriteItem, TensorWriteData, WriteItemType, _StorageInfo, ...).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                     "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint._extension")
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def _numpy_globals() -> list:
    """What an RNG file written before they held tensors needs: numpy's MT19937 key array."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def _reason(e: Exception) -> str:
    """The useful part of torch's weights_only refusal (a paragraph) as a clause."""
    msg = str(e)
    m = re.search(r"GLOBAL ([\w.]+)", msg)
    if m:
        return f"it would call {m[1]}, which is neither a tensor nor plain data"
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip() and not ln.startswith("Weights only load failed")]
    return lines[0] if lines else msg


def load_torch(src: str | bytes | BinaryIO, name: str | None = None):
    """`torch.load(weights_only=True)` of one pickled checkpoint file (a path, its bytes or a binary
    stream; `name` says which file in errors); raises CheckpointError naming the file."""
    import torch

    from train.model.cpu_compat import import_megatron

    import_megatron()  # for its allow-list (megatron.core.safe_globals)

    name = name or (src if isinstance(src, str) else "checkpoint file")
    f = io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{name}: refused to load: {_reason(e)}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch.distributed.checkpoint metadata and nothing else: the module and name are checked
    before anything is imported or called."""

    def find_class(self, module: str, name: str):
        import torch

        if module == "torch":
            obj = getattr(torch, name, None)
            if name == "Size" or isinstance(obj, torch.dtype):
                return obj
        elif (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        elif module in _METADATA_MODULES or module.startswith("megatron.core.dist_checkpointing."):
            import sys

            obj = getattr(sys.modules.get(module), name, None)  # only modules already imported
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def load_dcp_metadata(f: BinaryIO, name: str = ".metadata"):
    """The Metadata object of a torch_dist checkpoint's `.metadata`; CheckpointError on anything else."""
    try:
        return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{name}: refused to load: {_reason(e)}") from None


class _SafePickleModule:
    """Stands in for the `pickle` module inside torch.distributed.checkpoint.filesystem: writing as
    before, `load` restricted to checkpoint metadata."""

    def __getattr__(self, attr):
        return getattr(pickle, attr)

    @staticmethod
    def load(f, *args, **kwargs):
        return load_dcp_metadata(f, getattr(f, "name", ".metadata"))


def _safe_load_bytes(self, read_item, value) -> None:
    """DefaultLoadPlanner.load_bytes with `load_torch` in place of torch.load(weights_only=False)."""
    from torch.distributed.checkpoint._nested_dict import set_element

    obj = load_torch(value, f"bytes item {read_item.dest_index.fqn}")
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def install() -> None:
    """Route torch.distributed.checkpoint's two unrestricted unpicklings (see the module docstring)
    through the checks here, in this process (idempotent)."""
    from torch.distributed.checkpoint import default_planner, filesystem

    if not isinstance(filesystem.pickle, _SafePickleModule):
        filesystem.pickle = _SafePickleModule()
    if default_planner.DefaultLoadPlanner.load_bytes is not _safe_load_bytes:
        default_planner.DefaultLoadPlanner.load_bytes = _safe_load_bytes


def check_file(rel: str, data: bytes, where: str) -> str | None:
    """A problem with checkpoint file `rel` (relative to the checkpoint folder `where`) whose bytes are
    `data`, or None: pickles must load under the rules above."""
    try:
        if rel.endswith(".pt"):
            load_torch(data, f"{where}/{rel}")
        elif rel.rsplit("/", 1)[-1] == ".metadata":
            load_dcp_metadata(io.BytesIO(data), f"{where}/{rel}")
    except CheckpointError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle: report it, do not crash verify
        return f"{where}/{rel}: unreadable ({type(e).__name__}: {e})"
    return None
