"""`FilterSpec`: one filter of a build config (its type and constructor keywords). Its own module, below both
datapipe.config (which holds the specs) and datapipe.filters (which builds the filters from them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class FilterSpec:
    """One datatrove filter; `params` are its constructor's keyword arguments (thresholds)."""
    type: Literal["gopher_repetition", "gopher_quality", "c4", "c4_paragraph", "fineweb", "language", "fasttext",
                  "code", "math_density", "classifier"]
    params: dict[str, Any] = field(default_factory=dict)
