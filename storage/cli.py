"""The `storage` command: inspect and verify datasets (and, as they land, loader and I/O benchmarks)."""
from __future__ import annotations

import sys

import click

from storage import fs
from storage.dataset import Dataset
from storage.manifest import MASKED_KINDS, read_manifest
from storage.shards import ShardError, iter_shard, parse_index


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Dataset format tools and storage benchmarks for smoltrain."""


@main.command()
@click.argument("dataset")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def inspect(dataset: str, as_json: bool) -> None:
    """Summarise DATASET (path or fsspec URL): sources, shards, blocks, documents, tokens, dtype, mix."""
    import json

    m = read_manifest(dataset)

    def rows(sources):
        return {n: {"kind": s.kind, "shards": len(s.shards), "blocks": sum(x.blocks for x in s.shards),
                    "documents": s.documents,
                    "tokens": s.tokens, "bytes": sum(x.bytes for x in s.shards)} for n, s in sources.items()}

    if as_json:
        click.echo(json.dumps({"dataset": dataset, "format_version": m.format_version,
                               "tokenizer": vars(m.tokenizer), "sources": rows(m.sources),
                               "validation": rows(m.validation), "mix": [vars(p) for p in m.mix],
                               "chat_template": m.chat_template}, indent=1))
        return
    t = m.tokenizer
    click.echo(f"dataset   {dataset}  (format v{m.format_version})")
    click.echo(f"tokenizer {t.file}  vocab {t.vocab_size:,}  eos {t.eos_id}  dtype {t.dtype}  sha256 {t.sha256[:12]}")
    click.echo(f"{'source':<16}{'shards':>8}{'blocks':>9}{'documents':>12}{'tokens':>15}{'MiB':>10}")
    for name, r in rows(m.sources).items():
        click.echo(f"{name:<16}{r['shards']:>8}{r['blocks']:>9}{r['documents']:>12,}"
                   f"{r['tokens']:>15,}{r['bytes'] / 2**20:>10.1f}")
    click.echo(f"{'total':<16}{sum(len(s.shards) for s in m.sources.values()):>8}"
               f"{sum(x.blocks for s in m.sources.values() for x in s.shards):>9}"
               f"{sum(s.documents for s in m.sources.values()):>12,}{m.total_tokens:>15,}")
    for name, r in rows(m.validation).items():
        click.echo(f"{'val/' + name:<16}{r['shards']:>8}{r['blocks']:>9}{r['documents']:>12,}"
                   f"{r['tokens']:>15,}{r['bytes'] / 2**20:>10.1f}")
    chat = [n for n, s in m.sources.items() if s.kind == "chat"]
    if chat:
        click.echo(f"chat sources (loss-masked conversations): {', '.join(chat)}; chat template: "
                   f"{len(m.chat_template or '')} characters of Jinja in the manifest")
    pref = [n for n, s in m.sources.items() if s.kind == "preference"]
    if pref:
        click.echo(f"preference sources (pairs: #chosen, #rejected documents): {', '.join(pref)}")
    for name, s in m.sources.items():
        if s.kind == "prompts":
            held = m.validation[name].documents if name in m.validation else 0
            click.echo(f"prompts source {name} (RL prompts up to the generation prompt): {s.documents:,} training "
                       f"+ {held:,} held out, {s.stats.get('with_answer', 0):,} of all with an answer")
    for ph in m.mix:
        w = ", ".join(f"{k}={v:g}" for k, v in ph.weights.items())
        click.echo(f"phase {ph.name}: {ph.tokens:,} tokens; weights {w}")


@main.command()
@click.argument("dataset")
def verify(dataset: str) -> None:
    """Check every shard of DATASET (training and held-out validation): sha256, tar safety, LZ4 frames,
    metadata, loss masks (format 2), prompt metadata, index and counts.

    Exits non-zero at the first corrupt shard, naming it and the member."""
    m = Dataset.open(dataset).manifest
    n = 0
    for name, src in [*m.sources.items(), *m.validation.items()]:
        for sh in src.shards:
            url = fs.join(dataset, sh.path)
            try:
                blocks = docs = toks = 0
                keys = []
                for b in iter_shard(url, expected_sha256=sh.sha256):
                    blocks += 1
                    docs += len(b.doc_ids)
                    toks += len(b.tokens)
                    keys.append(b.key)
                    if b.source != name:
                        raise ShardError(url, f"block says source {b.source!r}, manifest says {name!r}", b.key)
                    if (b.mask is not None) != (src.kind in MASKED_KINDS):
                        raise ShardError(url, f"block {'has' if b.mask is not None else 'lacks'} a loss mask, but "
                                         f"the manifest says source {name!r} is of kind {src.kind!r}", b.key)
                    if (b.doc_meta is not None) != (src.kind == "prompts" or src.content in ("code", "math")):
                        raise ShardError(url, f"block {'has' if b.doc_meta is not None else 'lacks'} doc_meta, but "
                                         f"the manifest says source {name!r} is of kind {src.kind!r}, content "
                                         f"{src.content!r}", b.key)
                if (blocks, docs, toks) != (sh.blocks, sh.documents, sh.tokens):
                    raise ShardError(url, f"counts (blocks, documents, tokens) = {(blocks, docs, toks)}, manifest "
                                     f"says {(sh.blocks, sh.documents, sh.tokens)}")
                idx = parse_index(fs.read_bytes(url + ".idx").decode(), url)
                if [e.key for e in idx] != keys:
                    raise ShardError(url + ".idx", "index does not list the shard's samples in order")
            except (ShardError, FileNotFoundError, EOFError) as e:
                click.echo(f"CORRUPT {e}", err=True)
                sys.exit(1)
            n += 1
    click.echo(f"ok: {n} shards verified")


from storage.bench.cli import bench  # noqa: E402
main.add_command(bench)
from storage.loader.bench import bench_loader  # noqa: E402
main.add_command(bench_loader, "bench-loader")

def entrypoint() -> None:
    """The console script: `main`, then an exit without the interpreter's teardown (storage.lifecycle)."""
    from storage.lifecycle import run_main

    run_main(main)


if __name__ == "__main__":
    entrypoint()
