"""smoltrain storage: the on-disk dataset format and everything that reads or measures it.

- `storage.shards`: shard format v1 (tar of LZ4 token blocks + JSON, DALI-style `.idx`), safe readers;
  `storage.shard_writer`: the atomic shard writer.
- `storage.dataset`: pack documents into blocks/shards per source; open a dataset.
- `storage.manifest`: `manifest.json` (tokenizer, shards with sha256, stats, mix schedule).
- `storage.fs`: local paths and fsspec URLs, reads and range reads with retries.
- `storage.atomic`: the one rule for temporary files (atomic writes of files and folders, the sweep of an
  interrupted run's leftovers, aborted multipart uploads).
- `storage.config` / `storage.cliutil`: typed YAML configs with `--set` overrides, shared by all CLIs.
- `storage.lifecycle`: helper processes (Manager servers, pool workers) that die with their parent.
- `storage.loader`: the streaming loader (elastic global order, mixing, prefetch, resume).
- `storage.bench`: `storage bench` (throughput, IOPS, latency, fio comparison, verdicts).
- `storage.cli`: the `storage` command (inspect, verify, bench, bench-loader).
"""
