"""Real distributed engines: a single-node Slurm cluster (munged, slurmctld, slurmd on localhost) and a Ray
cluster of a head and a second node process, each started once for this module. A build on each gives the
bytes of the local executor's build, after kill -9 of a task's process mid-way (Slurm: the waiting driver
resubmits it; Ray: Ray reruns it), then kill -9 of the driver, and a rerun."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from testutil import free_port, read_corpus, require, require_root, unavailable, write_jsonl

from datapipe.config import BuildConfig
from datapipe.pipeline import Build
from storage import config as cfgmod

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """Slurm on localhost (one node of 2 CPUs, partition debug) with its own munged, all state in a temp dir;
    yields the environment of its clients (SLURM_CONF)."""
    daemons = [shutil.which(d) or shutil.which(d, path="/usr/sbin") for d in ("munged", "slurmctld", "slurmd")]
    if not all(daemons) or not shutil.which("sbatch"):
        unavailable("Slurm is not installed (munged, slurmctld, slurmd, sbatch)", "run make sysdeps as root",
                    installed_here=os.geteuid() == 0 and shutil.which("apt-get") is not None)
    require_root("the test Slurm cluster (slurmd starts jobs as their user)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir(mode=0o700)
    key, socket, conf = d / "munge" / "munge.key", d / "munge" / "sock", d / "slurm.conf"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    conf.write_text("\n".join([
        "ClusterName=datapipetest", "SlurmctldHost=localhost", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "SlurmUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={socket}", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",  # start a job within a second of its dependency ending
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none", "MailProg=/bin/true",
        "ReturnToService=2", "KillWait=5",
        "SlurmdParameters=config_overrides",  # the node's CPUs and memory as configured, whatever the host has
        "NodeName=localhost CPUs=2 RealMemory=4000 State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""]))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    munged, slurmctld, slurmd = daemons
    log = d / "log" / "daemons.log"
    procs: list[subprocess.Popen] = []
    try:
        with open(log, "w") as out:
            for cmd in ([munged, "-F", "--force", f"--socket={socket}", f"--key-file={key}", f"--pid-file={d}/munged.pid",
                         f"--seed-file={d}/munge/seed", f"--log-file={d}/log/munged.log"],
                        [slurmctld, "-D", "-f", str(conf)], [slurmd, "-D", "-f", str(conf), "-N", "localhost"]):
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
                if cmd[0] == munged:
                    _wait_for(socket.exists, 10, "munged's socket", log)

        def idle() -> bool:
            return subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                  text=True).stdout.strip() == "idle"

        _wait_for(idle, 30, "the Slurm node", log)
        yield env
    finally:
        subprocess.run(["scancel", "--me"], env=env, capture_output=True)
        with contextlib.suppress(TimeoutError):
            _wait_for(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout,
                      15, "the cancelled jobs")
        # what a job or a failed test left (slurmstepd daemonizes, out of the daemons' tree; a driver) has
        # the cluster's SLURM_CONF
        _kill_all(procs, [p for p in psutil.process_iter() if _environ(p).get("SLURM_CONF") == str(conf)])


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head and a second node process (1 CPU each) on this machine, on ports of their own and with a
    token of their own; yields (address, environment of a driver, pids of the two `ray start` processes)."""
    require("ray")
    d = tmp_path_factory.mktemp("ray")
    # Ray's socket paths live under --temp-dir and must stay under 108 bytes (AF_UNIX): a short folder of
    # its own, not pytest's (which is longer under pytest-xdist: .../popen-gw0/ray0)
    short = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0"}
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    try:
        for head in (True, False):  # started together: the second node waits for the head
            cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus=1",
                   "--node-ip-address=127.0.0.1", "--disable-usage-stats", "--object-store-memory=100000000",
                   "--include-log-monitor=false", "--min-worker-port=0", "--max-worker-port=0",  # 0: any free port
                   *(f"--{k}={free_port()}" for k in (
                       "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                       "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"))]
            cmd += (["--head", f"--port={port}", f"--ray-client-server-port={free_port()}",
                     f"--dashboard-port={free_port()}", "--include-dashboard=false", f"--temp-dir={short}"]
                    if head else [f"--address=127.0.0.1:{port}"])
            logs.append(d / ("head.log" if head else "node.log"))
            with open(logs[-1], "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        for p, log in zip(procs, logs):
            _wait_for(lambda: p.poll() is not None or "Ray runtime started" in log.read_text(), 90,
                      f"ray start ({log.name})", log)
            assert p.poll() is None, f"ray start failed:\n{log.read_text()[-3000:]}"
        yield f"127.0.0.1:{port}", env, {p.pid for p in procs}
    finally:  # with the workers and any driver a failed test left: all have the cluster's token
        _kill_all(procs, [p for p in psutil.process_iter()
                          if _environ(p).get("RAY_AUTH_TOKEN") == env["RAY_AUTH_TOKEN"]])
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_tokenizer):
    """(root, config, files of the local executor's dataset). Every build here writes to ROOT/ds (the
    manifest records the output path), then moves it aside."""
    root = tmp_path_factory.mktemp("engines")
    fortunes = read_corpus("fortunes", 3000)
    paths = [write_jsonl(root / "in" / f"web{i}.jsonl", fortunes[i::2]) for i in range(2)]
    cfg = {"output": str(root / "ds"), "tokenizer": {"path": small_tokenizer},
           "shards": {"block_tokens": 8192, "shard_blocks": 4}, "dedup": {"minhash": {"bands": 2, "rows": 4, "cluster_parts": 2, "cluster_rounds": 1}},
           "sources": [{"name": "web", "paths": paths}]}
    Build(cfgmod.from_dict(BuildConfig, cfg), workers=2).run(progress=False)
    files = _files(root / "ds")
    assert "manifest.json" in files and sum(k.endswith(".tar") for k in files) > 1
    shutil.move(root / "ds", root / "local")
    return root, cfg, files


@pytest.mark.timeout(300)
def test_slurm_build_equals_local_after_killed_task_and_driver(slurm_cluster, reference):
    root, cfg, want = reference
    work = root / "ds" / "_work"
    config = _config(root, cfg, {"kind": "slurm", "slurm": {"partition": "debug", "mem_per_cpu_gb": 1,
                                                            "time": "00:10:00", "retries": 1}})

    def find(stage: str):
        """Running Slurm tasks of the stage: the build's python running datatrove's launcher on the stage's
        executor.pik; the rank is the array index (the first submission runs every rank, in order)."""
        pik = str(work / "logs" / stage / "executor.pik")
        for proc in psutil.process_iter(["cmdline"]):
            if (proc.info["cmdline"] or [])[-2:] == ["datatrove.tools.launch_pickled_pipeline", pik]:
                yield proc, int(_environ(proc).get("SLURM_ARRAY_TASK_ID", -1))

    driver = _driver(config, slurm_cluster, root / "slurm-1.log", "--wait")
    rank = _kill_worker(driver, work, "scan", find)
    _kill_driver_in(driver, work, "tokenize")
    # the driver saw the task fail and resubmitted the chain, which got past the scan stage
    assert _done(work, "scan") == {0, 1} and "resubmitting" in _log(root / "slurm-1.log"), rank
    _finish(config, slurm_cluster, root / "slurm-2.log", "--set", "executor.slurm.wait=true")  # = --wait
    assert _files(root / "ds") == want
    # stage times from the task markers (the rerun found the scan done: 0 s)
    report = json.loads((root / "ds" / "build_report.json").read_text())["elapsed_s"]
    assert list(report) == ["scan", "exact", "buckets", "verify", "clusters", "tokenizer", "tokenize",
                            "validation", "manifest"] and report["scan"] == 0 and min(report.values()) >= 0
    shutil.move(root / "ds", root / "slurm")


@pytest.mark.timeout(300)
def test_ray_build_equals_local_after_killed_worker_and_driver(ray_cluster, reference):
    address, env, starters = ray_cluster
    root, cfg, want = reference
    work = root / "ds" / "_work"
    config = _config(root, cfg, {"kind": "ray", "ray": {"address": address}})

    def tasks() -> list[tuple[psutil.Process, str, int]]:
        """(process, title, raylet pid) of this cluster's workers running a datapipe task (Ray titles the
        process after the task: ray::datapipe-STAGE-RANK; its parent is a raylet, child of `ray start`)."""
        out = []
        for proc in psutil.process_iter(["cmdline", "ppid"]):
            title = " ".join(proc.info["cmdline"] or []).strip()
            if title.startswith("ray::datapipe-") and _parent(proc.info["ppid"]) in starters:
                out.append((proc, title, proc.info["ppid"]))
        return out

    def find(stage: str):
        for proc, title, _ in tasks():
            if title.startswith(f"ray::datapipe-{stage}-"):
                yield proc, int(title.rsplit("-", 1)[1])

    with _sampled(lambda: {raylet for _, _, raylet in tasks()}) as raylets:
        driver = _driver(config, env, root / "ray-1.log")
        _kill_worker(driver, work, "scan", find)
        _kill_driver_in(driver, work, "tokenize")
        assert _done(work, "scan") == {0, 1}  # Ray reran the killed task
        # Ray ends the dead driver's tasks: none may run beside the rerun's
        _wait_for(lambda: not tasks(), 30, "the end of the killed driver's Ray tasks")
        _finish(config, env, root / "ray-2.log")
    assert _files(root / "ds") == want
    assert len(raylets) == 2, "the tasks did not run on both Ray nodes"
    shutil.move(root / "ds", root / "ray")


def _files(out: Path) -> dict[str, bytes]:
    """Every file of a dataset but the build's scratch, its rejects (gzip headers carry a time) and timings."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.relative_to(out).as_posix().startswith(("_work/", "rejects/"))
            and p.name != "build_report.json"}


def _config(root: Path, cfg: dict, executor: dict) -> Path:
    """The config on that executor; clears the output a failed test may have left."""
    shutil.rmtree(root / "ds", ignore_errors=True)
    path = root / f"{executor['kind']}.yaml"
    path.write_text(yaml.safe_dump({**cfg, "executor": executor}))
    return path


def _driver(config: Path, env: dict, log: Path, *args: str) -> subprocess.Popen:
    """`datapipe build CONFIG` in the background, its output to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "datapipe.cli", "build", str(config), "--quiet", *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def _finish(config: Path, env: dict, log: Path, *args: str) -> None:
    driver = _driver(config, env, log, *args)
    assert driver.wait(timeout=240) == 0, _log(log)


def _log(path: Path) -> str:
    return path.read_text()[-4000:]


def _done(work: Path, stage: str) -> set[int]:
    d = work / "logs" / stage / "completions"
    return {int(n) for n in os.listdir(d)} if d.is_dir() else set()


def _kill_worker(driver: subprocess.Popen, work: Path, stage: str, find) -> int:
    """SIGKILL one task of `stage` while it runs (its task log is there, its completion is not): every process
    of that rank, since a task's forked children carry its command line and rank too, and killing a child
    alone leaves the task to finish; `find(stage)` yields (process, rank) of the stage's running tasks.
    Returns the rank."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and driver.poll() is None:
        running = list(find(stage))
        for proc, rank in running:
            if (work / "logs" / stage / "logs" / f"task_{rank:05d}.log").exists() and rank not in _done(work, stage):
                procs = [p for p, r in running if r == rank]
                for p in procs:
                    p.kill()
                psutil.wait_procs(procs, timeout=10)
                assert rank not in _done(work, stage), f"task {rank} of {stage} ended before the kill"
                return rank
        time.sleep(0.02)
    driver.kill()
    raise AssertionError(f"no running {stage} task to kill (driver exit status {driver.wait()})")


def _kill_driver_in(driver: subprocess.Popen, work: Path, stage: str) -> None:
    """SIGKILL the driver (alone) once a task of `stage` has started."""
    logs = work / "logs" / stage / "logs"
    _wait_for(lambda: driver.poll() is not None or logs.is_dir() and any(logs.iterdir()), 120, f"a {stage} task")
    assert driver.poll() is None, f"the build ended (exit status {driver.returncode}) before its driver was killed"
    driver.kill()
    driver.wait()


def _wait_for(cond, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s\n{_log(log) if log and log.exists() else ''}")
        time.sleep(0.05)


def _kill_all(procs: list[subprocess.Popen], others: list[psutil.Process] = ()) -> None:
    """SIGKILL each process, its process group and every descendant (found before any of them dies), and
    the `others` with their descendants."""
    tree = list(others)
    for proc in others:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += proc.children(recursive=True)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += psutil.Process(p.pid).children(recursive=True)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()  # psutil checks that the pid still names the same process
    for p in procs:
        p.wait()


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


def _parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


@contextlib.contextmanager
def _sampled(sample):
    """Yields a set: the union of sample() (a set) taken every 50 ms while inside."""
    seen: set = set()
    stop = threading.Event()

    def run():
        while not stop.wait(0.05):
            seen.update(sample())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()
