"""The demo's embedded corpus: real text every Python installation carries, written as JSONL.gz.

Two sources, so the demo can show filtering, dedup and a two-phase mix without any download:
- `docs`: the language reference topics shipped for `pydoc` plus module, class and function docstrings
  of the standard library (English technical prose);
- `code`: the standard library's source, one document per top-level function or class (Python code,
  with the natural near-duplicates a large code base has).
"""
from __future__ import annotations

import ast
import gzip
import json
import sysconfig
from pathlib import Path
from typing import Iterator


def _stdlib_files(limit: int | None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    return files[:limit] if limit else files


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def docs_documents(limit_files: int | None = None) -> Iterator[dict]:
    import pydoc_data.topics as topics

    for name in sorted(topics.topics):
        yield {"id": f"topic/{name}", "text": topics.topics[name]}
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files(limit_files):
        tree = _parse(path)
        if tree is None:
            continue
        rel = path.relative_to(root).as_posix()
        nodes = [("module", tree)] + [(n.name, n) for n in ast.walk(tree)
                                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for name, node in nodes:
            doc = ast.get_docstring(node)
            if doc:
                yield {"id": f"doc/{rel}:{name}:{getattr(node, 'lineno', 0)}", "text": doc}


def code_documents(limit_files: int | None = None) -> Iterator[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files(limit_files):
        text = path.read_text(encoding="utf-8", errors="replace")
        tree = _parse(path)
        if tree is None:
            continue
        lines = text.splitlines(keepends=True)
        rel = path.relative_to(root).as_posix()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.end_lineno:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                yield {"id": f"code/{rel}:{node.name}", "text": "".join(lines[start - 1:node.end_lineno])}


def write_corpus(out_dir: str | Path, limit_files: int | None = None) -> dict[str, Path]:
    """Write docs.jsonl.gz and code.jsonl.gz under out_dir (deterministic bytes); return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, docs in (("docs", docs_documents(limit_files)), ("code", code_documents(limit_files))):
        path = out / f"{name}.jsonl.gz"
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            for d in docs:
                gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode())
        paths[name] = path
    return paths


if __name__ == "__main__":
    import sys

    for name, p in write_corpus(sys.argv[1] if len(sys.argv) > 1 else "demo-out/raw").items():
        n = sum(1 for _ in gzip.open(p, "rt"))
        print(f"{name}: {n} documents, {p.stat().st_size / 1e6:.1f} MB gz -> {p}")
