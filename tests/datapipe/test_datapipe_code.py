"""`kind: code` and `kind: math` sources, end to end on one build: real files of several languages, the
generated files a code crawl holds, planted secrets, near-copies, bad input, and math with formulas."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from testutil import require, write_jsonl

from datapipe.config import BuildConfig, FilterSpec, ShardsConfig, SourceConfig, TokenizerConfig, ValidationConfig
from datapipe.pipeline import Build
from datapipe.tokenize import load_tokenizer
from storage.manifest import read_manifest
from storage.shards import iter_shard
from tools.bench import code_corpus as cc

MATH = [
    ("sum", "The sum of the first $n$ odd numbers is a square. Indeed $$\\sum_{k=1}^{n} (2k-1) = n^2,$$ which "
            "one proves by induction: the case $n=1$ holds, and adding $2n+1$ to $n^2$ gives $(n+1)^2$. The same "
            "picture of nested squares explains why the identity holds for every natural number."),
    ("euler", "Euler's identity \\(e^{i\\pi} + 1 = 0\\) links five constants. It follows from the series "
              "\\[ e^{x} = \\sum_{k \\ge 0} \\frac{x^k}{k!} \\] with $x = i\\pi$, since the even terms give the "
              "cosine and the odd ones the sine of the angle, and the cosine of pi is minus one."),
    ("matrix", "A matrix is invertible when its determinant is not zero.\n\\begin{align*}\n\\det(AB) &= "
               "\\det(A)\\det(B) \\\\\n\\det(A^{-1}) &= 1/\\det(A)\n\\end{align*}\nSo the product of two "
               "invertible matrices is invertible, and the inverse of the product is the product of the inverses "
               "in the opposite order, as one checks by multiplying them out."),
    ("price", "The shop sold apples for $5 and pears for $10 on Monday, and most of the customers paid in cash "
              "at the counter near the door. The owner said that the prices would stay the same for the rest of "
              "the month, since the harvest had been good and the weather mild all season."),
    ("dense", "We compute the integral step by step, starting from the simplest power. $$\\int_0^1 x^2 \\, dx = "
              "\\left[ \\frac{x^3}{3} \\right]_0^1 = \\frac{1}{3} - 0 = \\frac{1}{3}$$ and in the same way "
              "$$\\int_0^1 x^3 \\, dx = \\frac{1}{4}, \\quad \\int_0^1 x^4 \\, dx = \\frac{1}{5}, \\quad "
              "\\int_0^1 x^n \\, dx = \\frac{1}{n+1}.$$ The pattern holds for every power, since the "
              "antiderivative of a power raises its exponent by one and divides by the new exponent, as the "
              "fundamental theorem of calculus tells us."),
]


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, small_tokenizer):
    """One build: `code` (JSONL with path, licence and repository fields), `files` (one file per document,
    with a binary, a Latin-1 and an unknown-extension file among them) and `math`."""
    root = tmp_path_factory.mktemp("kinds")
    real = [f for f in cc.real_files(0) if f["path"].startswith("stdlib/")][:60]
    js = next(f["text"] for f in cc.shipped() if f["path"].endswith(".js"))
    py = next(f["text"] for f in real if f["path"] == "stdlib/textwrap.py") if any(
        f["path"] == "stdlib/textwrap.py" for f in real) else real[0]["text"]
    originals = [f for f in real if f["text"].count("\n") > 40][:12]
    copies = cc.near_copies([{"path": f["path"], "text": f["text"]} for f in originals])
    records = real + cc.shipped() + cc.generated(js, py) + cc.planted_secrets() + cc.license_pair() + copies
    for i, r in enumerate(records):
        r["id"] = f"c{i:04d}"
        r["license"] = ["MIT"] if i % 3 == 0 else "Apache-2.0"
        r["repo_name"] = f"org/repo{i % 4}"
    code = write_jsonl(root / "code" / "files.jsonl",
                       [{k: r[k] for k in ("id", "path", "text", "license", "repo_name")} for r in records])
    files = root / "tree"
    (files / "sub").mkdir(parents=True)
    (files / "sub" / "helper.py").write_text('"""Helpers."""\n\n\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))'
                                             '\n\n\ndef lerp(a, b, t):\n    return a + (b - a) * t\n')
    (files / "tool").write_text("#!/usr/bin/env python3\n" + "import sys\n" * 3 + "print(sys.argv)\nsys.exit(0)\n")
    (files / "blob.c").write_bytes(b"int main(void) {\n  return 0;\n}\n\x00\x01\x02binary tail\n")
    (files / "latin1.c").write_bytes("/* caf\xe9 */\nint x;\nint y;\nint z;\nint w;\n".encode("latin-1"))
    (files / "notes.xyz").write_text("some words\n" * 6)
    math = write_jsonl(root / "math" / "m.jsonl", [{"id": k, "text": t} for k, t in MATH])
    cfg = BuildConfig(output=str(root / "out"), sources=[
        SourceConfig("code", [code], kind="code"),
        SourceConfig("files", [str(files / "**")], format="text", kind="code"),
        SourceConfig("math", [math], kind="math", filters=[FilterSpec("gopher_quality", {"min_doc_words": 20}),
                                                           FilterSpec("math_density", {"min_density": 0.0})])],
        tokenizer=TokenizerConfig(path=small_tokenizer), shards=ShardsConfig(block_tokens=4096, shard_blocks=8),
        validation=ValidationConfig(fraction=0.0))
    Build(cfg).run(progress=False)
    return cfg, records, copies


def _docs(out: str, source: str) -> dict[str, tuple[str, dict]]:
    """id → (decoded text, doc_meta) of a source's training documents."""
    tok = load_tokenizer(str(Path(out) / "tokenizer.json"))
    m, out_docs = read_manifest(out), {}
    for sh in m.sources[source].shards:
        for b in iter_shard(str(Path(out) / sh.path)):
            for k, doc_id in enumerate(b.doc_ids):
                ids = b.tokens[b.offsets[k]:b.offsets[k + 1] - 1].tolist()  # EOS dropped
                out_docs[doc_id] = (tok.decode(ids), b.doc_meta[k])
    return out_docs


def _rejects(out: str) -> dict[str, tuple[str, str, dict]]:
    """path or id → (reject folder, reason, metadata) of every rejected document."""
    found = {}
    for p in sorted((Path(out) / "rejects").rglob("*.jsonl.gz")):
        with gzip.open(p, "rt") as f:
            for line in f:
                d = json.loads(line)
                found[d["metadata"].get("path") or d["id"]] = (p.parent.name, d["metadata"].get("filter_reason"),
                                                               d["metadata"])
    return found


def test_code_filters_reject_generated_files_with_their_reason(kinds):
    cfg, records, _ = kinds
    rejects = _rejects(cfg.output)
    js = next(f["text"] for f in cc.shipped() if f["path"].endswith(".js"))
    generated = cc.generated(js, "x = 1\n")
    for f in generated:
        assert rejects[f["path"]][:2] == ("0_code", f["reason"]), f["path"]
    for name, reason in cc.SHIPPED_REASONS.items():
        assert rejects[name][1] == reason
    kept = _docs(cfg.output, "code")
    assert {f"code/c{i:04d}" for i, r in enumerate(records) if r["path"] in ("ringbuf.c", "stats.rs", "lru.go",
                                                                              "Tokenizer.java", "backup.sh")} <= set(kept)
    st = read_manifest(cfg.output).sources["code"].stats
    for reason in ("autogenerated", "encoded_data", "max_line_length"):
        assert st[f"dropped_0_code:{reason}"] >= sum(f["reason"] == reason for f in generated), reason
    assert {"code_language:python", "code_language:c", "code_language:go", "code_language:rust",
            "code_language:java", "code_language:javascript", "code_language:shell", "license:MIT"} <= set(st)


def test_code_doc_meta_languages_paths_licences(kinds):
    cfg, records, _ = kinds
    docs = _docs(cfg.output, "code")
    by_path = {r["path"]: r for r in records}
    for doc_id, (text, meta) in docs.items():
        rec = by_path[meta["path"]]
        assert meta["language"] and meta["repo"] == rec["repo_name"] and meta["license"] == rec["license"]
    assert docs[next(k for k, (_, m) in docs.items() if m["path"] == "lru.go")][1]["language"] == "go"
    files = _docs(cfg.output, "files")
    # one document per file, its id the path under the pattern's folder; a `#!` script without extension
    assert {k: m["language"] for k, (_, m) in files.items()} == {"files/sub/helper.py": "python",
                                                                  "files/tool": "python"}


def test_bad_code_input_is_named_counted_and_kept_out(kinds):
    cfg, _, _ = kinds
    rejects = _rejects(cfg.output)
    assert rejects["blob.c"][:2] == ("read", "binary file (a NUL character at offset 31)")
    assert rejects["latin1.c"][:2] == ("read", "not UTF-8 at byte 6")
    assert rejects["latin1.c"][2]["file"].endswith("tree/latin1.c")
    assert rejects["notes.xyz"][:2] == ("codelang", "unknown_language")
    st = read_manifest(cfg.output).sources["files"].stats
    assert st["read"] == 5 and st["dropped_read"] == 2 and st["dropped_codelang:unknown_language"] == 1


def test_no_planted_secret_anywhere_in_the_output(kinds):
    """Keys, tokens, private keys and passwords of 14 kinds, e-mail and IP addresses: none in the shards
    (decoded), the rejects, the dedup reports or the work dir; counted per kind in the manifest."""
    cfg, _, _ = kinds
    planted = cc.planted_secrets()
    secrets = [s for f in planted for s in f["secrets"]]
    assert len({k for f in planted for k in f["kinds"]}) >= 14
    texts = [t for t, _ in _docs(cfg.output, "code").values()]
    assert sum("<KEY>" in t for t in texts) >= 4 and any("<PASSWORD>" in t for t in texts)
    for p in Path(cfg.output).rglob("*"):
        if p.is_file() and not p.name.endswith((".tar", ".idx")):
            data = gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes()
            texts.append(data.decode("utf-8", "replace"))
    leaked = [s for s in secrets if any(s in t for t in texts)]
    assert not leaked, leaked
    st = read_manifest(cfg.output).sources["code"].stats
    for kind in ("aws_access_key", "github_token", "slack_token", "stripe_access_key", "json_web_token",
                 "private_key", "password", "email", "ip_address"):
        assert st.get(f"redacted:{kind}", 0) >= 1, kind


def test_near_copies_removed_licence_header_files_kept(kinds):
    cfg, records, copies = kinds
    ids = {r["path"]: f"code/{r['id']}" for r in records}
    kept = set(_docs(cfg.output, "code"))
    removed = [c for c in copies if ids[c["path"]] not in kept]
    assert len(removed) / len(copies) >= 0.95, [c["path"] for c in copies if ids[c["path"]] in kept]
    assert all(ids[c["of"]] in kept for c in copies)  # the originals (higher priority) stay
    assert {ids[f["path"]] for f in cc.license_pair()} <= kept  # only their licence header is shared


def test_math_formulas_kept_byte_for_byte_and_masked_from_prose_rules(kinds):
    from datatrove.pipeline.filters import GopherQualityFilter
    from datatrove.data import Document

    from datapipe.kinds.mathtext import density, spans

    cfg, _, _ = kinds
    docs = _docs(cfg.output, "math")
    assert set(docs) == {f"math/{k}" for k, _ in MATH}
    for key, text in MATH:
        out, meta = docs[f"math/{key}"]
        assert [text[a:b] for a, b in spans(text)] == [out[a:b] for a, b in spans(out)]
        assert (meta["formulas"] > 0) == (key != "price") and meta["math_density"] == density(text)[0]
    dense = dict(MATH)["dense"]  # judged as written, the prose rule drops it; with formulas masked it stays
    assert GopherQualityFilter(min_doc_words=20).filter(Document(text=dense, id="d")) is not True
    st = read_manifest(cfg.output).sources["math"].stats
    assert st["formulas"] == sum(len(spans(t)) for _, t in MATH)
    assert sum(v for k, v in st.items() if k.startswith("kept_math_density:")) == len(MATH)


def test_unknown_kind_and_misplaced_rules_are_config_errors(tmp_path):
    from datapipe.cli import main

    bad = tmp_path / "build.yaml"
    for source, message in [({"kind": "cod"}, "key 'sources.0.kind': expected one of 'web', 'code', 'math'"),
                            ({"kind": "code", "languages": ["pyton"]}, "key 'sources.0.languages.0': unknown "
                             "programming language 'pyton' (closest: python"),
                            ({"kind": "math", "filters": [{"type": "c4"}]}, "key 'filters.0': filter 'c4' rewrites")]:
        bad.write_text(json.dumps({"sources": [{"name": "s", "paths": ["x.jsonl"], **source}]}))
        res = CliRunner().invoke(main, ["build", str(bad)])
        assert res.exit_code != 0 and str(bad) in res.output and message in res.output, res.output


def test_code_rules_agree_with_nemo_curator(kinds):
    """Rule by rule, on these files, our decisions equal those of NeMo Curator's code filters (the full
    table on thousands of files: tools/bench/bench_code.py)."""
    require("nemo_curator.stages.text.filters.heuristic.code.code")
    from tools.bench import code_peer

    _, records, _ = kinds
    docs = code_peer.documents(records)
    rows = code_peer.agreement(docs)
    assert all(not r["disagree"] for r in rows), [r for r in rows if r["disagree"]]
    assert sum(r["peer"] for r in rows if r["peer"] is not None) >= 10  # the peer rejects for several rules


def test_encoded_data_shortcut_equals_the_plain_regexes():
    """StarCoder2's three regexes, run only where they can match (datapipe.kinds.codefilter), give the
    matches of a plain `finditer` on adversarial strings and on real files."""
    import random

    from datapipe.kinds.codefilter import B64, HEX, UNI, encoded_lengths

    rng = random.Random(7)
    alphabet = "0123456789abcdefxX\\u, \n\t=+/gz_é\u00a0\u3000;"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(20, 400))) for _ in range(3000)]
    texts += [f["text"] for f in cc.real_files(0)[:80]] + ["é00 11 22 33 44 55 66 77 88 99", "\\u0041" * 9]
    for t in texts:
        assert sorted(encoded_lengths(t)) == sorted(m.end() - m.start() for p in (B64, HEX, UNI)
                                                    for m in p.finditer(t)), repr(t)


def test_redaction_line_gates_lose_nothing():
    """Scanning only the lines the gates pass finds what detect-secrets finds scanning every line."""
    from detect_secrets.core.scan import _process_line_based_plugins

    from datapipe.kinds import redact

    r = redact.Redactor(emails=False, ip_addresses=False)
    files = cc.planted_secrets() + [f for f in cc.real_files(0) if re.search(r"passw|secret|key|token", f["text"])][:25]
    found = 0
    for f in files:
        keys, words, _ = r.find(f["text"], f["path"])
        every = {s.secret_value for s in _process_line_based_plugins(list(enumerate(f["text"].split("\n"), 1)),
                                                                      f["path"])}
        assert keys | {v for vs in words.values() for v in vs} == every, f["path"]
        found += len(every)
    assert found >= 15
