"""Output trees compared file by file, hidden files included: what a build or a training run killed at any
point and rerun to the end must reproduce of the uninterrupted run (tools/kill_trials.py and the kill
tests use it).

Every file under the root counts, by its bytes, except the few that differ between two uninterrupted runs
of the same config; those are listed here, each with its reason and what is compared instead (None: not
compared at all), and in docs/datapipe.md ("Temporary files and interrupted runs"). The root's own path,
where a file records it (a run's config.yaml), is compared as `<ROOT>`, so runs in different folders compare.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Callable

Normalizer = Callable[[str, bytes], bytes] | None  # (path, bytes) -> what is compared; None: nothing


def _same(path: str, data: bytes) -> bytes:
    return data


def _presence(path: str, data: bytes) -> bytes:
    return b""


def _without(*keys: str) -> Normalizer:
    def norm(path: str, data: bytes) -> bytes:
        obj = json.loads(data)
        return json.dumps({k: v for k, v in obj.items() if k not in keys}, sort_keys=True).encode()
    return norm


def _ckpt_manifest(path: str, data: bytes) -> bytes:
    """A checkpoint's manifest without its creation time and save stall, and without the sizes and
    checksums of raw tensor files and their padded byte count (see _raw_pieces)."""
    m = json.loads(data)
    for k in ("created", "stall_s", "tensor_bytes"):
        m.pop(k, None)
    m["files"] = {rel: (None if rel.startswith("tensors/") else f) for rel, f in m.get("files", {}).items()}
    return json.dumps(m, sort_keys=True).encode()


def _raw_index(path: str, data: bytes) -> bytes:
    idx = json.loads(data)
    idx["entries"] = [{k: v for k, v in e.items() if k != "offset"} for e in idx["entries"]]
    return json.dumps(idx, sort_keys=True).encode()


def _raw_pieces(path: str, data: bytes) -> bytes:
    """A full checkpoint's raw tensor file places each piece at a file offset congruent to its memory
    address modulo 4 KiB (train.checkpoint.rawfile.aligned_offsets, for O_DIRECT), so two runs pad it
    differently: compared are the pieces, in index order, each with its index entry."""
    try:
        with open(path[:-len(".bin")] + ".json") as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError):
        return data  # no readable index: the bytes themselves
    out = []
    for e in entries:
        out.append(json.dumps({k: v for k, v in e.items() if k != "offset"}, sort_keys=True).encode())
        out.append(data[e["offset"]:e["offset"] + e["nbytes"]])
    return b"\0".join(out)


# metrics.jsonl fields that are functions of the config and seed (the rest are wall times and speeds)
_STEP_FIELDS = ("step", "loss", "grad_norm", "lr", "global_batch_size", "consumed_tokens", "skipped_steps",
                "nonfinite_steps", "spike_steps", "loss_tokens", "pairs", "packing_efficiency", "row_width",
                "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen",
                "logps_rejected")


def _metrics(path: str, data: bytes) -> bytes:
    """The last step record of each step (a resumed run logs again the steps after its checkpoint) with
    the deterministic fields, and the last eval record of each step without its timing; events ("resumed
    at step N") are a run's history, not its result. A killed run's cut last line is skipped."""
    steps, evals = {}, {}
    for line in data.decode().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r:
            steps[r["step"]] = {k: r.get(k) for k in _STEP_FIELDS}
        elif r.get("kind") == "eval":
            evals[r["step"]] = {k: v for k, v in r.items() if k not in ("time", "eval_time_s")}
    return json.dumps({"steps": sorted(steps.items()), "evals": sorted(evals.items())}).encode()


# (glob over the path relative to the root, how it is compared); the first match decides
BUILD_VOLATILE: list[tuple[str, Normalizer]] = [
    ("_work/logs/*/completions/*", _same),  # task completion markers: compared
    ("_work/logs/*", None),  # datatrove's task logs, stats and executor.json: times, timings, object addresses
    ("build_report.json", None),  # seconds per stage
]
TRAIN_VOLATILE: list[tuple[str, Normalizer]] = [
    ("logs/*", None),  # each rank's log: timestamps
    ("tb/*", None),  # TensorBoard event files: wall times, host name in the file name
    ("metrics.jsonl", _metrics),  # per-step results compared, speeds and times not (see _metrics)
    ("*step_*/manifest.json", _ckpt_manifest),  # creation time, save stall, raw files' padding
    ("*step_*/tensors/rank*.bin", _raw_pieces),  # raw tensor files: the pieces, not the padding
    ("*step_*/tensors/rank*.json", _raw_index),  # ... and their index without the offsets
    ("*/.recycle/*", _presence),  # retired tensor files kept only to be overwritten: present, never read
    ("eval/*.json", _without("evaluated_at")),
]


def tree(root: str, volatile: list[tuple[str, Normalizer]]) -> dict[str, str]:
    """{relative path: sha256 of its bytes (or of its normalized form)} of every file under `root`, hidden
    files and folders included (the root's path inside a file read as `<ROOT>`); symlinks by their target."""
    out = {}
    roots = sorted({os.fsencode(os.path.abspath(root)), os.fsencode(os.path.realpath(root))}, key=len, reverse=True)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            rule = next((norm for pattern, norm in volatile if fnmatch.fnmatchcase(rel, pattern)), _same)
            if rule is None:
                continue
            if os.path.islink(path):
                data = b"symlink:" + os.readlink(path).encode()
            else:
                with open(path, "rb") as f:
                    data = f.read()
            for r in roots:
                data = data.replace(r, b"<ROOT>")
            out[rel] = hashlib.sha256(rule(path, data)).hexdigest()
    return out


def differences(ref: dict[str, str], got: dict[str, str], limit: int = 20) -> list[str]:
    """What tells `got` from `ref` (empty: identical), one line per path."""
    lines = [f"missing: {p}" for p in sorted(set(ref) - set(got))]
    lines += [f"extra: {p}" for p in sorted(set(got) - set(ref))]
    lines += [f"differs: {p}" for p in sorted(set(ref) & set(got)) if ref[p] != got[p]]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])
