"""Byte sizes: parse "64K", "8MiB", "1.5G" (binary units) and format them back."""
from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes in `text`; K/M/G/T are powers of 1024 (KiB, KB and K mean the same here)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 8MiB, 1G)")
    n = float(m.group(1)) * _UNITS[m.group(2)]
    if n <= 0 or n != int(n):
        raise ValueError(f"size must be a positive whole number of bytes: {text!r}")
    return int(n)


def parse_list(text: str, conv=parse_size) -> list[int]:
    out = [conv(x) for x in str(text).split(",") if x.strip()]
    if not out:
        raise ValueError(f"empty list: {text!r}")
    return out


def fmt_size(n: float) -> str:
    for unit, div in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"
