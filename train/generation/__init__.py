"""Text generation from a checkpoint or a Hugging Face folder: `train generate` (chat.py).

May import: storage, train.model, train.monitor, train.checkpoint, and train.state / train.config
(docs/architecture.md); train.eval and the objectives build on it.
"""
