"""Deduplication across all sources: exact (normalised-text hash) and MinHash near-duplicates."""
