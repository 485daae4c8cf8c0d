"""The model and its parallel layout: presets and the megatron-core GPTModel build (gpt.py), numeric
precision and the FP8 check (precision.py), process groups, seeds and DDP wrapping (parallel.py), document
masking of packed rows (docmask.py), and the compatibility layer that runs megatron-core on CPU under gloo
(cpu_compat.py).

May import: storage, megatron-core and torch; nothing else of train (the lowest layer;
docs/architecture.md). Importing this package imports no megatron.
"""
