"""What a training or evaluation process shows on the console, and what it writes to its log file.

megatron-core and torch warn at every import and in every process (Transformer Engine / Apex not
installed, CUDA_DEVICE_MAX_CONNECTIONS, deprecations): dozens of lines per `train launch`, repeated by the
checkpoint writer's helper processes. `quiet()`, called by an entry module (train.run, train.eval.run)
before megatron is imported, routes them through Python's own machinery instead of printing them:

- `logging.captureWarnings(True)`: every Python warning becomes a record of the logger "py.warnings";
- records of "py.warnings", of megatron's loggers ("megatron", INFO and up) and of ours ("train",
  "storage", "datapipe", INFO and up) go to the process's log file, RUN_DIR/logs/rank<RANK>.log (held in
  memory until the file is known: `to_file`);
- the console keeps what a user must see: our loggers' warnings and errors (as before: the bare message,
  e.g. "removed 1 stale temporary folder from an interrupted run: ..."), megatron's errors, and Python
  warnings raised by our own code (train/, storage/, datapipe/, tools/). Progress lines are printed, not
  logged: unchanged.
  Tracebacks of uncaught exceptions are untouched.

`train launch` passes the log folder in SMOLTRAIN_LOG_DIR, so each rank opens its file at import time;
the checkpoint writer's helper processes (spawned: they re-import the entry module) inherit it and append
to their rank's file. `notice()` is the one line rank 0 prints at start: what is missing that changes how
the model runs, and where the log file is.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path

ENV_DIR = "SMOLTRAIN_LOG_DIR"
OURS = ("train", "storage", "datapipe")
_LIBS = ("megatron",)
_REPO = str(Path(__file__).resolve().parents[1])
_OUR_DIRS = tuple(os.path.join(_REPO, d) + os.sep for d in (*OURS, "tools"))
# cpu_compat's TorchFunctionMode runs every torch call of the process, so torch attributes the warnings
# of megatron's calls to it (e.g. "The .grad attribute of a Tensor that is not a leaf"): library warnings
_PASS_THROUGH = (os.path.join(_REPO, "train", "cpu_compat.py"),)
# the file and line of a formatted warning: "PATH:LINE: Category: message"
_WARN_PATH = re.compile(r"^(.*?):\d+: ")
_FMT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_state: dict = {"held": None, "file": None, "console": None}


class _Held(logging.Handler):
    """Keeps records (at most `cap`) until the log file is known, then hands them to it."""

    def __init__(self, cap: int = 2000):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.cap = cap
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.cap:
            self.records.append(record)
        else:
            self.dropped += 1


class _ConsoleFilter(logging.Filter):
    """What stays on the console: our loggers' warnings, megatron's errors, warnings from our own code."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name.split(".")[0]
        if name == "py":  # py.warnings: keep those raised in our own code
            m = _WARN_PATH.match(record.getMessage())
            path = os.path.abspath(m.group(1)) if m else ""
            return path.startswith(_OUR_DIRS) and path not in _PASS_THROUGH
        if name in OURS:
            return record.levelno >= logging.WARNING
        return record.levelno >= logging.ERROR


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def log_path(log_dir: str | os.PathLike, prefix: str = "") -> Path:
    return Path(log_dir) / f"{prefix}rank{_rank()}.log"


def quiet(prefix: str = "") -> None:
    """Route warnings and library logging as described above (idempotent). With SMOLTRAIN_LOG_DIR set,
    the log file is opened now; else records are held until `to_file`."""
    if _state["console"] is not None:
        return
    logging.captureWarnings(True)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(message)s"))  # lastResort's format: messages read as before
    console.addFilter(_ConsoleFilter())
    held = _Held()
    for name in ("py.warnings", *_LIBS, *OURS):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO if name != "py.warnings" else logging.WARNING)
        lg.propagate = False
        lg.addHandler(console)
        lg.addHandler(held)
    _state.update(console=console, held=held)
    if os.environ.get(ENV_DIR):
        to_file(log_path(os.environ[ENV_DIR], prefix))


def to_file(path: str | os.PathLike) -> Path:
    """Open (append) the log file, write the held records to it and send later ones there. Exports its
    folder in SMOLTRAIN_LOG_DIR for helper processes. Returns the path."""
    path = Path(path)
    if _state["file"] is not None:
        return Path(_state["file"].baseFilename)
    if _state["console"] is None:
        quiet()
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(path, encoding="utf-8")
    fh.setFormatter(logging.Formatter(_FMT))
    fh.stream.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} rank {_rank()}: "
                    f"{' '.join(sys.argv)}\n")
    held: _Held = _state["held"]
    for name in ("py.warnings", *_LIBS, *OURS):
        lg = logging.getLogger(name)
        lg.removeHandler(held)
        lg.addHandler(fh)
    for rec in held.records:
        fh.handle(rec)
    if held.dropped:
        fh.stream.write(f"({held.dropped} earlier records dropped)\n")
    fh.flush()
    _state.update(file=fh, held=None)
    os.environ[ENV_DIR] = str(path.parent)
    return path


def current_file() -> Path | None:
    fh = _state["file"]
    return Path(fh.baseFilename) if fh is not None else None


def missing_kernels() -> str | None:
    """What a user must know once about this install, or None: Transformer Engine absent means the local
    layer spec (no fused attention / layernorm kernels, no FP8); it is all megatron's import warnings say."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine not installed: local layer spec, no fused kernels"
    return None


def notice() -> str:
    """The one setup line rank 0 prints: what changes how the model runs, and where the details are."""
    parts = [p for p in (missing_kernels(),) if p]
    f = current_file()
    if f is not None:
        parts.append(f"library messages: {re.sub(r'rank[0-9]+[.]log$', 'rank*.log', str(f))}")
    return "[setup] " + "; ".join(parts) if parts else ""


# Warnings that `missing_kernels` sums up (megatron repeats them at every import of its optimizer, FSDP
# and grad-clipping modules) and one about a megatron default we do not set.
EXPECTED = (r".*(Transformer Engine|Apex).* not installed", r".*cuda_graph_scope")


def ignore_expected() -> None:
    """For commands that write no log file (the `train` CLI's export, generate, merge, eval --hf): drop
    the expected warnings above; any other warning still shows."""
    for pattern in EXPECTED:
        warnings.filterwarnings("ignore", message=pattern)
