"""Source kinds beyond web prose: code (programming language, The Stack's filters, secrets redaction, code
shingles) and math (formulas kept and masked from the prose rules, a math-density signal)."""

KINDS_WITH_META = ("code", "math")


def doc_meta(kind: str, meta: dict) -> dict:
    """The shard's per-document metadata (`doc_meta`) of a code or math document: code its programming
    language and the record's path, repository and licence where it has them; math its density and formulas."""
    if kind == "code":
        return {"language": meta["code_language"], **{k: meta[k] for k in ("path", "repo", "license") if meta.get(k)}}
    return {"math_density": meta.get("math_density", 0.0), "formulas": meta.get("formulas", 0)}


def licenses(meta: dict) -> list[str]:
    """A code document's licences (its `license` metadata: a string, a list, or absent)."""
    value = meta.get("license")
    return [value] if isinstance(value, str) else list(value or [])
