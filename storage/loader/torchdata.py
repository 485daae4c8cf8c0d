"""Use the loader inside a torch DataLoader with worker processes, keeping the global order.

Worker w of N builds a TokenLoader that yields batches w, w + N, w + 2N, ... of this rank's stream
(each already a full [G / W, seq_len + 1] batch), and the DataLoader returns workers' results round-robin
in worker order, so the batches arrive in exactly the order of a plain TokenLoader. Use `batch_size=None`:

    ds = TokenIterableDataset(cfg, G, dp_rank, dp_size, state=sd)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    ... after n batches: sd = ds.state_dict(n)   # same format as TokenLoader.state_dict()
"""
from __future__ import annotations

import torch

from storage.loader.config import LoaderConfig
from storage.manifest import Phase


class TokenIterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, cfg: LoaderConfig, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 mix: list[Phase] | None = None, state: dict | None = None):
        super().__init__()
        self.cfg, self.G, self.rank, self.world, self.mix, self.state = cfg, global_batch_size, dp_rank, dp_size, \
            mix, state

    def _loader(self, offset: int, stride: int):
        from storage.loader.loader import TokenLoader

        loader = TokenLoader(self.cfg, self.G, self.rank, self.world, self.mix, batch_offset=offset,
                             batch_stride=stride)
        if self.state is not None:
            loader.load_state_dict(self.state)
        return loader

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        offset, stride = (0, 1) if info is None else (info.id, info.num_workers)
        loader = self._loader(offset, stride)
        try:
            yield from loader
        finally:
            loader.close()

    def state_dict(self, batches_consumed: int) -> dict:
        """Loader state after the DataLoader has returned `batches_consumed` batches from this dataset."""
        loader = self._loader(0, 1)
        try:
            loader._yielded = batches_consumed
            return loader.state_dict()
        finally:
            loader.close()
