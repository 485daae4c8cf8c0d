"""smoltrain datapipe: raw documents → filtered, deduplicated, tokenized shards with a mix schedule.

`datapipe build CONFIG` reads named sources (fsspec paths/globs of JSONL(.gz/.zst), Parquet or text, or
Hugging Face dataset folders: `datasets` save_to_disk, Hub-style Parquet), normalises Unicode, applies
datatrove's Gopher/C4/FineWeb filters (with a fast spaCy-compatible English word tokenizer), removes exact
and MinHash near-duplicates across sources (kept in the highest-priority source, clusters reported),
tokenizes with HF `tokenizers` (a local tokenizer.json or a BPE trained offline) and writes shard format v1
per source plus `manifest.json` with counts and the mix schedule, through `storage`, and a Hub dataset card
(README.md). Stages run on datatrove's Local executor, on a Ray cluster or as a Slurm job chain, are
resumable, and give byte-identical output for the same config and inputs on every engine.

Modules: cli (commands), config (typed configs), inputs + hfdata (input files and dataset folders), sources
(readers), normalize, filters + wordtok (quality filters), dedup/ (exact, minhash), tokenize, steps (one-task
stages), pipeline (stage assembly, manifest), card (dataset card), executors (local, Ray), slurm (job chain),
report, demo (embedded stdlib corpus). Reference: docs/datapipe.md.
"""
