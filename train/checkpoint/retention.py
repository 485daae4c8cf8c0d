"""Which checkpoints to keep: the newest k, every K-th full one forever, and every base a kept one needs."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class _Ckpt(Protocol):
    name: str
    step: int
    kind: str
    base: str | None


def keep_set(ckpts: Iterable[_Ckpt], keep_last: int, full_every: int, keep_full_every: int) -> set[str]:
    """Names to keep. A full checkpoint is kept forever when its step is a multiple of
    keep_full_every * full_every; an incremental's base is kept as long as the incremental is."""
    ckpts = sorted(ckpts, key=lambda c: c.step)
    keep = {c.name for c in ckpts[-keep_last:]} if keep_last > 0 else set()
    if keep_full_every > 0 and full_every > 0:
        period = keep_full_every * full_every
        keep |= {c.name for c in ckpts if c.kind == "full" and c.step % period == 0}
    by_name = {c.name: c for c in ckpts}
    for name in list(keep):
        base = by_name[name].base
        while base:  # chains are one level deep today; the loop keeps deeper ones safe too
            keep.add(base)
            base = by_name[base].base if base in by_name else None
    return keep


def to_delete(ckpts: Iterable[_Ckpt], keep_last: int, full_every: int, keep_full_every: int) -> list[str]:
    ckpts = list(ckpts)
    keep = keep_set(ckpts, keep_last, full_every, keep_full_every)
    return [c.name for c in sorted(ckpts, key=lambda c: c.step) if c.name not in keep]
