"""smoltrain datapipe: raw documents → filtered, deduplicated, tokenized shards with a mix schedule.

Built on datatrove (readers, filters, MinHash stages, executors) and HF `tokenizers`; writes shard
format v1 through `storage`. Entry point: the `datapipe` command (`datapipe.cli`).
"""
