"""CheckpointManager: the trainer's one interface to checkpoints (cadence, async saves, resume,
retention, offload).

    mgr = CheckpointManager(cfg, run_dir)
    resumed = mgr.resume(state)          # newest verifying checkpoint, in place; False when none
    mgr.maybe_save(state)                # after every optimizer step; cadence decides; async
    mgr.before_update()                  # before every optimizer step (async saves copy the state meanwhile)
    mgr.wait(); mgr.close()              # before exit / destroy_process_group
"""
from __future__ import annotations

import logging
import os

import fsspec

from storage import atomic
from train.checkpoint import layout, retention
from train.checkpoint.config import CheckpointConfig
from train.checkpoint.incremental import retire
from train.checkpoint.offload import Offloader, pull_newest
from train.checkpoint.resume import broadcast_choice, choose_local, load_into
from train.checkpoint.save import Saver, barrier, rank_world
from train.state import TrainState

log = logging.getLogger("train.checkpoint")


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: str, meta: dict | None = None):
        """meta: JSON-serialisable run facts stored in every manifest (e.g. the model config for export)."""
        self.cfg = cfg
        self.root = os.path.abspath(cfg.dir if os.path.isabs(cfg.dir) else os.path.join(run_dir, cfg.dir))
        self.rank, self.world = rank_world()
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            atomic.sweep(self.root)  # saves an interrupted run left unfinished: removed and counted
        barrier()
        self.saver = Saver(self.root, cfg, meta)
        self.saver.on_commit = self._on_commit
        self.offloader = None
        if cfg.offload_url and self.rank == 0:
            self.offloader = Offloader(cfg.offload_url, self.root, cfg.keep_local, cfg.keep_last,
                                       cfg.full_every, cfg.keep_full_every)
        self._base_name: str | None = None  # newest full checkpoint whose values we hold
        self._base: dict | None = None
        self._last_step: int | None = None
        self.skipped: list[str] = []  # messages about checkpoints that did not verify at resume

    # -- resume -------------------------------------------------------------------------------------
    def resume(self, state: TrainState) -> bool:
        name = None
        if self.rank == 0:
            name, self.skipped = choose_local(self.root, self.cfg.verify_on_resume)
            if name is None and self.cfg.offload_url:
                name = pull_newest(self.cfg.offload_url, self.root, self.cfg.verify_on_resume)
            if name is not None and layout.read_latest(fsspec.filesystem("file"), self.root) != name:
                layout.write_latest(self.root, name)  # it pointed at a broken or missing checkpoint
            if name is not None and not self.skipped and self.offloader is None:
                self._retain()  # a run killed between a commit and its retention
        name = broadcast_choice(name)
        if name is None:
            return False
        out = load_into(state, self.root, name, self.cfg)
        self._base_name, self._base = out["base_name"], out["base_snapshot"]
        self._last_step = state.step
        return True

    # -- save ---------------------------------------------------------------------------------------
    def maybe_save(self, state: TrainState, force: bool = False) -> bool:
        """Save if the cadence asks for one at state.step (or force: a full one). Returns True if started."""
        self._finalize(block=False)
        kind = self.cfg.kind_at(state.step)
        if force:
            kind = "full"
        if kind is None or state.step == self._last_step:
            return False
        if kind == "incremental" and self._base is None:
            kind = "full"  # nothing to build on yet (fresh run, or base not in memory)
        self._finalize(block=True)  # at most one save in flight
        self.saver.start(state, kind, self._base_name, self._base)
        self._last_step = state.step
        if not self.cfg.async_save:
            self.wait()
        return True

    def before_update(self) -> float:
        """Call before the optimizer step changes parameters or optimizer state: waits (rarely) for the host
        copy of a save started after the previous step. Returns the seconds waited."""
        return self.saver.wait_staged()

    def _finalize(self, block: bool) -> None:
        p = self.saver.poll(block)
        if p is not None and p.info.get("ok") and p.kind == "full":
            self._base_name, self._base = p.name, p.new_base

    def _on_commit(self, manifest: dict) -> None:
        """Rank 0, commit thread: retention (without offload) or hand-off to the offloader."""
        if self.offloader is not None:
            self.offloader.submit(manifest["name"])
            return
        self._retain()

    def _retain(self) -> None:
        ckpts = layout.list_checkpoints(fsspec.filesystem("file"), self.root)
        for name in retention.to_delete(ckpts, self.cfg.keep_last, self.cfg.full_every, self.cfg.keep_full_every):
            retire(self.root, name)
            log.info("checkpoint %s deleted (retention; its tensor files kept for reuse)", name)

    @property
    def failed(self) -> list[str]:
        """Messages of saves that were not committed (background write or commit failed)."""
        return self.saver.failed + (self.offloader.errors if self.offloader else [])

    def wait(self) -> None:
        """Block until the save in flight is written and committed (and, on rank 0, offloaded)."""
        self._finalize(block=True)
        self.saver.wait_commits()
        if self.offloader is not None:
            self.offloader.wait()

    def close(self) -> None:
        self.wait()
        self.saver.close()
        if self.offloader is not None:
            self.offloader.close()
