"""Small atomic readers/writers for the build's intermediate files under the work directory."""
from __future__ import annotations

import io
import json
import os

import numpy as np

from storage import atomic


def calibration_path(work: str, source: str, index: int) -> str:
    """The threshold file of a `keep_top` classifier filter (datapipe.quality.calibrate writes it)."""
    return os.path.join(work, "calibration", f"{source}.{index}.json")


def atomic_json(path: str, obj) -> None:
    atomic.write_bytes(path, json.dumps(obj, separators=(",", ":")).encode())


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def atomic_npy(path: str, arr: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    atomic.write_bytes(path, buf.getvalue())


def load_npy(path: str, dtype) -> np.ndarray:
    if not os.path.exists(path):
        return np.zeros(0, dtype=dtype)
    return np.load(path, allow_pickle=False).astype(dtype, copy=False)
