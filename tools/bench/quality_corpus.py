"""The quality benchmark's labelled text, all real and public: well-written reference prose (the Python
documentation's reST sections, ../shared/corpora/pydoc.jsonl.gz) against boilerplate-heavy pages from
Debian's documentation on this machine (/usr/share/doc/*/copyright licence blocks, changelog.Debian.gz
entries, README.Debian), cut into pieces of the prose's length so that length alone does not separate them.

Every document goes to one of three disjoint parts by a hash of its id: `label` (the classifier's examples),
`train` (the ablation's training source, both kinds mixed) and `heldout` (pydoc only: the ablation's
validation set of the "good" kind).
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPORA = REPO.parent / "shared" / "corpora"
MIN_CHARS, MAX_CHARS = 400, 3000


def _part(doc_id: str) -> str:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:4], "little") % 100
    return "label" if h < 30 else "train" if h < 80 else "heldout"


def prose() -> list[dict]:
    out = []
    with gzip.open(CORPORA / "pydoc.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if len(d["text"]) >= MIN_CHARS:
                out.append({"id": f"pydoc/{d['id']}", "text": d["text"][:MAX_CHARS], "kind": "prose"})
    return out


def _pieces(path: str, text: str) -> list[dict]:
    """Consecutive paragraphs joined up to MAX_CHARS; pieces under MIN_CHARS dropped."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > MAX_CHARS:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    out.append(cur)
    return [{"id": f"{path}#{i}", "text": t[:MAX_CHARS], "kind": "boilerplate"}
            for i, t in enumerate(out) if len(t.strip()) >= MIN_CHARS]


def boilerplate(root: str = "/usr/share/doc") -> list[dict]:
    files = sorted(glob.glob(f"{root}/*/copyright") + glob.glob(f"{root}/*/changelog.Debian.gz")
                   + glob.glob(f"{root}/*/README.Debian"))
    if not files:
        raise SystemExit(f"no Debian documentation under {root}: the benchmark's negative class comes from there")
    out = []
    for p in files:
        opener = gzip.open if p.endswith(".gz") else open
        try:
            with opener(p, "rt", encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        out.extend(_pieces(os.path.relpath(p, root), text))
    return out


def parts(per_class: int) -> dict[str, list[dict]]:
    """label / train / heldout documents; the label part has at most `per_class` of each kind."""
    split: dict[str, list[dict]] = {"label": [], "train": [], "heldout": []}
    for docs in (prose(), boilerplate()):
        n_label = 0
        for d in docs:
            part = _part(d["id"])
            if part == "heldout" and d["kind"] != "prose":
                part = "train"
            if part == "label":
                if n_label >= per_class:
                    continue
                n_label += 1
            split[part].append(d)
    return split


def write_jsonl(path: Path, docs: list[dict], label: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            rec = {"id": d["id"], "text": d["text"]}
            if label:
                rec["label"] = "hq" if d["kind"] == "prose" else "lq"
            f.write(json.dumps(rec) + "\n")
    return path
