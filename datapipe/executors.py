"""Run one build stage on datatrove's Local executor or on Ray (Slurm chains whole builds: datapipe.slurm).

Local is the default (`workers` processes). Ray starts a local Ray (`ray.num_cpus`) or joins the cluster
at `ray.address`, and runs each task of a stage as one Ray task (`RayExecutor`), as many at once as the
cluster's CPUs allow; a task whose worker process or node dies is rerun by Ray (`ray.max_retries`).
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys

from datatrove.executor.base import DistributedEnvVars, PipelineExecutor
from datatrove.executor.local import LocalPipelineExecutor

from datapipe.executorconfig import ExecutorConfig
from storage.lifecycle import die_with_parent, managers_die_with_parent


def _cache_loguru_lib_dirs() -> None:
    """loguru works out the interpreter's library folders (sysconfig, ~7 ms) in every `logger.add`, and
    datatrove adds sinks several times per task: remember them per `sys.path`, so a stage of small tasks
    is not mostly logging set-up."""
    from loguru import _better_exceptions as be

    compute, found = be.ExceptionFormatter._get_lib_dirs, {}

    def lib_dirs():
        key = tuple(sys.path)
        if key not in found:
            found[key] = compute()
        return found[key]

    be.ExceptionFormatter._get_lib_dirs = staticmethod(lib_dirs)


_cache_loguru_lib_dirs()


class LocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor with three changes:
    - its Manager process (otherwise left blocked forever) and its pool workers are killed when their
      parent dies (the build itself; the forkserver, which exits with the build), so a build killed with
      SIGKILL leaves no process behind, and no orphaned worker finishes a task beside the rerun of it;
    - with `quiet`, every worker's console shows warnings and errors only, one line each (`quiet_datatrove`,
      applied inside the worker: forkserver workers do not inherit the build's patch). Full logs go to the
      stage's logging_dir;
    - with one worker, tasks run in the build's process without datatrove's Manager process (and merged
      stats.json; the per-task stats are in `stats/`): a stage of small tasks costs its work only.
    """

    def __init__(self, *args, quiet: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.quiet, self.main_pid = quiet, os.getpid()

    def run(self):
        if self.workers == 1:  # in this process, one task after another, without the Manager process
            pipeline = self.pipeline
            try:
                for rank in self.get_incomplete_ranks():
                    self.pipeline = copy.deepcopy(pipeline)  # steps keep per-task state (stats)
                    self._run_for_rank(rank)
            finally:
                self.pipeline = pipeline
            return
        from multiprocess import managers

        with managers_die_with_parent(managers):  # datatrove's task counter lives in a Manager process
            return super().run()

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        if os.getpid() != self.main_pid:  # a pool worker (with workers == 1 tasks run in the build itself)
            die_with_parent()
            # the workers fill the cores: BPE encoding threads in each would only contend with the others
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        if not self.quiet:
            return super()._run_for_rank(rank, local_rank, node_rank)
        with quiet_datatrove():
            try:
                return super()._run_for_rank(rank, local_rank, node_rank)
            finally:  # datatrove re-adds a DEBUG console sink when a task ends; its "N/M tasks" lines follow
                console_sink()


def console_sink() -> None:
    """The console shows warnings and errors as one line each: a failed task's traceback is in its log
    file (the stage's logging_dir), not on screen."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", format=lambda r: "{level}: {message}\n")


@contextlib.contextmanager
def quiet_datatrove(verbose: bool = False):
    """datatrove prints every task's pipeline and stats at INFO; keep the console to warnings (the full
    logs are still written to each stage's logging_dir)."""
    if verbose:
        yield
        return
    from datatrove.executor import base
    from loguru import logger

    add, close = base.add_task_logger, base.close_task_logger

    def quiet_add(logging_dir, rank, local_rank=0, node_rank=-1):
        """datatrove's add_task_logger with a one-line console sink (its own prints tracebacks there)."""
        logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
        console_sink()
        logger.add(logfile, level="DEBUG", colorize=False,
                   format="{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <8} | {name}:{function}:{line} - {message}")
        return logfile

    def quiet_close(logfile):
        close(logfile)
        console_sink()

    console_sink()
    base.add_task_logger, base.close_task_logger = quiet_add, quiet_close
    try:
        yield
    finally:
        base.add_task_logger, base.close_task_logger = add, close


@contextlib.contextmanager
def task_bar(name: str, tasks: int, logging_dir: str, enabled: bool):
    """A per-stage progress bar fed by datatrove's completion markers (works for every executor)."""
    if not enabled:
        yield
        return
    import threading

    from tqdm import tqdm

    done_dir = os.path.join(logging_dir, "completions")
    bar = tqdm(total=tasks, desc=f"  {name}", unit="task", leave=False)
    stop = threading.Event()

    def poll():
        while not stop.wait(0.2):
            n = len(os.listdir(done_dir)) if os.path.isdir(done_dir) else 0
            bar.update(n - bar.n)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        bar.close()


def run_stage(ex: ExecutorConfig, name: str, pipeline: list, tasks: int, workers: int, logging_dir: str,
              verbose: bool = False, progress: bool = False) -> None:
    with quiet_datatrove(verbose), task_bar(name, tasks, logging_dir, progress):
        _run_stage(ex, name, pipeline, tasks, workers, logging_dir, verbose)


def _run_stage(ex: ExecutorConfig, name: str, pipeline: list, tasks: int, workers: int, logging_dir: str,
               verbose: bool = False) -> None:
    if ex.kind == "ray":
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=ex.ray.address, num_cpus=None if ex.ray.address else ex.ray.num_cpus,
                     include_dashboard=False, log_to_driver=False, configure_logging=False)
        RayExecutor(pipeline, tasks, logging_dir, name, ex.ray.cpus_per_task, ex.ray.max_retries).run()
    else:
        LocalExecutor(pipeline, tasks=tasks, workers=max(1, min(workers, tasks)), logging_dir=logging_dir,
                      skip_completed=True, quiet=not verbose).run()
    _check_complete(name, logging_dir, tasks)


def _check_complete(name: str, logging_dir: str, tasks: int) -> None:
    done = os.path.join(logging_dir, "completions")
    missing = [r for r in range(tasks) if not os.path.exists(os.path.join(done, f"{r:05d}"))]
    if missing:
        raise RuntimeError(f"stage {name!r}: tasks {missing[:10]} did not complete; see {logging_dir}/logs/")


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("executor.kind is 'ray' but Ray is not installed; install it with "
                           "`pip install 'ray>=2.9'` (or `pip install smoltrain[ray]`)") from None
    return ray


class RayExecutor(PipelineExecutor):
    """One Ray task per incomplete rank, run in the Ray worker process itself and retried by Ray when that
    process or its node dies. datatrove's RayPipelineExecutor runs each task in a pool process forked by
    an actor instead: SIGKILL of that process (the one doing the work, so the OOM killer's pick) leaves
    the stage waiting forever, and SIGKILL of the actor leaves it running beside the task's retry.
    Task logs go straight to `logging_dir` (on the file system the nodes share), as for the other executors.
    """

    def __init__(self, pipeline: list, tasks: int, logging_dir: str, stage: str, cpus_per_task: int = 1,
                 max_retries: int = 3):
        super().__init__(pipeline, logging_dir, skip_completed=True)
        self.tasks, self.stage, self.cpus_per_task, self.max_retries = tasks, stage, cpus_per_task, max_retries

    @property
    def world_size(self) -> int:
        return self.tasks

    def get_distributed_env(self, node_rank: int = -1) -> DistributedEnvVars:
        return DistributedEnvVars(datatrove_node_ips="", datatrove_cpus_per_task=str(self.cpus_per_task),
                                  datatrove_mem_per_cpu="", datatrove_gpus_on_node="0", datatrove_executor="RAY")

    def run(self) -> None:
        import ray

        ranks = self.get_incomplete_ranks()
        if not ranks:
            return
        me = ray.put(self)
        task = ray.remote(num_cpus=self.cpus_per_task, max_retries=self.max_retries)(_ray_task)
        refs = {task.options(name=f"datapipe-{self.stage}-{r:05d}").remote(me, r): r for r in ranks}
        errors = {}
        for ref, rank in refs.items():  # every task ends before the stage reports its failures
            try:
                ray.get(ref)
            except Exception as e:
                errors[rank] = e
        if errors:
            rank, e = min(errors.items())
            cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the task's own exception
            raise RuntimeError(f"stage {self.stage!r}: tasks {sorted(errors)[:10]} failed; task {rank}: "
                               f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[-1][:300]} "
                               f"(see {self.logging_dir.path}/logs/)")


def _ray_task(executor: RayExecutor, rank: int) -> None:
    executor._run_for_rank(rank)
