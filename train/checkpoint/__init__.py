"""Checkpoints: async, sharded, incremental, atomic; resume under any layout; offload; HF export.

- Full checkpoints are megatron dist_checkpointing saves of the model and optimizer sharded state dicts
  whose tensors are written as raw bytes per rank at storage speed (`rawfile.py`; torch_dist for a
  flattened optimizer state); incremental ones store only XOR deltas (byte planes, zstd where they
  shrink) of main-replica tensor pieces against the newest full checkpoint (their base) and reference
  it (`incremental.py` with the byte-plane codec in `planes.py`, `strategies.py`).
- Saves are asynchronous: the host copy runs beside the next forward/backward and training waits for
  it only at `before_update()`; a background thread writes; the next save or `wait()` finalizes (`save.py`).
- Every checkpoint is written under `.tmp-…`, checksummed (XXH3-128 per file in manifest.json), fsynced,
  renamed, and then `latest` moves (`layout.py`); resume takes the newest one that verifies (`resume.py`).
- Retention keeps the newest k, every K-th full one and the bases they need (`retention.py`); offload
  copies to an fsspec URL and deletes local copies only after the remote verifies (`offload.py`).
- `train ckpt list|verify|export|import` (`cli.py`); export to a Hugging Face Llama folder (`export_hf.py`),
  import from one (`import_hf.py`); `train launch --init` loads weights only (`init_from.py`).
See docs/checkpoints.md.

May import: storage, train.model, train.monitor, and train.state / train.config (docs/architecture.md).
"""
from train.checkpoint.config import CheckpointConfig

__all__ = ["CheckpointConfig", "CheckpointManager"]


def __getattr__(name):
    # CheckpointManager pulls in megatron-core; import it lazily so config loading stays light.
    if name == "CheckpointManager":
        from train.checkpoint.manager import CheckpointManager
        return CheckpointManager
    raise AttributeError(name)
