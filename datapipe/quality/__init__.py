"""Quality by model: LLM annotations of a sample, classifiers trained on them, and the filter that keeps
documents by their score (docs/datapipe.md)."""
