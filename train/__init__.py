"""smoltrain train: a Megatron-core GPT trainer (TP × PP × DP) with monitoring, alerts and checkpoints.

Entry point: the `train` command (`train.cli`).
"""
