"""Test helpers importable from any test module: corpora access, small shard-format datasets, and
killable subprocess runs."""
from __future__ import annotations

import contextlib
import gzip
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from storage.dataset import SourceWriter
from storage.manifest import Manifest, Phase, TokenizerInfo, write_manifest

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"


CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(what: str, fix: str, installed_here: bool = True):
    """The one place that decides what a missing test prerequisite means (`require`, `require_tool`,
    `corpus_path` call it). Under CI (env CI=true) a prerequisite that `make test` provides (a dev
    dependency, a stock tool of `make sysdeps`, the corpora) must be there: the test fails, naming it and
    the fix. Elsewhere, or where the install does not provide it (`installed_here` False: e.g. DALI off
    Linux x86_64), the test is skipped with the same words. What a machine truly lacks (CUDA) stays a
    plain skip at the test."""
    if CI and installed_here:
        pytest.fail(f"CI: {what}: {fix}", pytrace=False)
    pytest.skip(f"{what} ({fix})", allow_module_level=True)


def require(module: str, installed_here: bool = True):
    """Import and return `module`, a dev dependency (`pip install -e '.[dev]'`, which `make install`
    runs); see `unavailable` for what happens when it does not import. Usable at module level."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        why = f"{type(e).__name__}: {e}"
    unavailable(f"dev dependency {module} is not installed ({why})", "run make install", installed_here)


def require_tool(name: str) -> str:
    """Path of a stock command-line tool the tests compare against (lz4, fio). `make test` runs `make
    sysdeps`, which installs it where it can (as root, with apt-get): there it must be present under CI."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"tool {name} is not installed", "run make sysdeps",
                    installed_here=os.geteuid() == 0 and shutil.which("apt-get") is not None)
    return path


def require_root(what: str) -> None:
    """A test that needs root (e.g. to run Slurm's daemons); CI runs `make test` as root (its `make sysdeps`
    installs packages with apt-get), so there a non-root run is a failure naming `what`, not a skip."""
    if os.geteuid() != 0:
        unavailable(f"{what} needs root, and this is uid {os.geteuid()}", "run the tests as root")


def corpus_path(name: str) -> Path:
    """../shared/corpora/NAME.jsonl.gz beside the repo; see `unavailable` for when it is absent."""
    p = CORPORA / f"{name}.jsonl.gz"
    if not p.exists():
        unavailable(f"corpus {p} is absent", "the corpora are expected at <repo>/../shared/corpora")
    return p


def read_corpus(name: str, limit: int | None = None, start: int = 0) -> list[dict]:
    """Documents start .. start + limit of a corpus."""
    out = []
    with gzip.open(corpus_path(name), "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if limit is not None and len(out) >= limit:
                break
            out.append(json.loads(line))
    return out


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> str:
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def write_random_dataset(root: str, sources: dict[str, int], vocab_size: int = 50_000, seed: int = 0,
                         block_tokens: int = 2048, shard_blocks: int = 4, eos_id: int = 0,
                         mix: list[Phase] | None = None) -> Manifest:
    """A dataset of random documents: `sources` maps name → number of documents."""
    rng = np.random.default_rng(seed)
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    infos = {}
    for name, n_docs in sources.items():
        w = SourceWriter(root, name, dtype, block_tokens=block_tokens, shard_blocks=shard_blocks)
        for i in range(n_docs):
            doc = rng.integers(1, vocab_size, int(rng.integers(5, 700)))
            w.add_document(f"{name}-{i}", np.append(doc, eos_id))
        infos[name] = w.close()
    if mix is None:
        mix = [Phase("stable", {n: 1.0 for n in sources}, sum(i.tokens for i in infos.values()))]
    m = Manifest(TokenizerInfo("tokenizer.json", "0" * 64, vocab_size, eos_id, dtype), infos, mix)
    write_manifest(root, m)
    return m




def default_sigint() -> None:
    """`preexec_fn` for a child that a test will send SIGINT: its SIGINT back to the default. A shell
    without job control (`make test &` in a script, some CI runners) starts background jobs with SIGINT
    ignored; children inherit that, Python then installs no KeyboardInterrupt handler, and the test's
    signal would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_killable(cmd: list[str], log, kill_when=None, timeout: float = 400, env: dict | None = None):
    """Run cmd in its own process group, output appended to `log`, and return its exit code. With
    `kill_when`: when kill_when() turns True, kill -9 the process, its group and every descendant (torchrun
    starts each worker in a session of its own, out of reach of the group kill), as a machine failure
    would, and return "killed" only if the process really died of that SIGKILL (exit status -9); if it
    finished by itself first (kill_when never turned True while it ran, or turned True too late), return
    "finished before the kill (exit status N)", so a caller's `== "killed"` fails saying why. Leftover
    processes of the group (e.g. checkpoint writer helpers) are killed either way."""
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        try:
            deadline = time.time() + timeout
            while p.poll() is None and time.time() < deadline:
                if kill_when is not None and kill_when():
                    _kill_tree(p.pid)
                    rc = p.wait()
                    return "killed" if rc == -signal.SIGKILL else _finished_first(out, rc)
                time.sleep(0.01)
            rc = p.wait(timeout=1)
            return rc if kill_when is None else _finished_first(out, rc)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill_tree(pid: int) -> None:
    """SIGKILL process `pid`, its process group and all its descendants, found before any of them dies."""
    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for proc in tree:
        try:
            proc.kill()  # psutil checks that the pid still names the same process
        except psutil.NoSuchProcess:
            pass


def _finished_first(out, rc: int) -> str:
    out.write(f"\n[run_killable: the process finished by itself (exit status {rc}) before any kill]\n")
    return f"finished before the kill (exit status {rc})"


def metric_records(run_dir) -> list[dict]:
    """The step records of RUN_DIR/metrics.jsonl (a killed run's cut last line is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r:
            out.append(r)
    return out


@contextlib.contextmanager
def megatron_one_rank(store_dir):
    """One gloo process with megatron's parallel state (TP = PP = 1, model-parallel seed 1) and the CPU
    compatibility layer, torn down afterwards; `store_dir` holds the process group's file store."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from train.model import cpu_compat

    cpu_compat.install()
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1)
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        cpu_compat.uninstall()


def run_gloo_workers(test_file: str, worker: str, out, nproc: int = 2, timeout: float = 180) -> dict:
    """torchrun `nproc` processes running `worker(out)` of the test module `test_file` (its folder and tests/ on
    PYTHONPATH, whatever the test process's sys.path holds); returns the JSON rank 0 wrote to `out`."""
    import sys

    here = os.path.dirname(os.path.abspath(test_file))
    module = Path(test_file).stem
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                        "--no-python", sys.executable, "-c", f"import {module} as t; t.{worker}({str(out)!r})"],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(Path(out).read_text())


def write_gathered(res: dict, out) -> None:
    """In a gloo worker: every rank's results gathered, rank 0 writes them to `out` as JSON; the model-parallel
    state and the process group torn down."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, res)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({k: v for g in got for k, v in g.items()}, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
