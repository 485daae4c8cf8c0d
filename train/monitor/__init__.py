"""Watching a run: FLOPs, MFU, memory, console / JSONL / TensorBoard sinks and alerts (metrics.py), time
in collectives (comm.py; comm_delay.py, a slow network for tests), console and per-rank log files (console.py), plots (plot.py), and the memory /
throughput estimator behind `train estimate` (estimate.py), the evaluation table (eval_table.py), experiment
trackers (trackers.py).

May import: storage, train.model, and train.state / train.config (docs/architecture.md).
"""
