"""Training from WebDataset shards: each epoch a (seed, epoch) permutation of the shards, split over readers, each
reader's samples shuffled in a buffer; a fixed number of steps per epoch; resume at each reader's next unopened shard.

Readers. A reader is one (rank, loader worker). Epoch e permutes the N shards by ``(seed, e)``; rank r takes
``perm[r::world]`` and its worker w takes ``that[w::workers]`` — webdataset's split_by_node then split_by_worker —
so no shard goes to two readers. A reader opens its shards in order, decodes each sample (bad ones are skipped and
counted by reason, ``mmgeo.data.shards.decode_sample``), passes it through a ``shuffle_buffer``-sample buffer
seeded by (seed, e, r, w), makes the training item through ``CaptionPairs.item`` (the caption, its negatives and
partial captions drawn from (seed, e, sample_id), as for map-style data) and yields collated local batches.

Epochs. ``samples_per_epoch // global_batch`` steps; each rank takes that many local batches from its workers in
turn (the DataLoader's round robin, skipping a worker whose shards are done) and the epoch ends there: shards not
reached are not read this epoch; within an epoch no shard is read twice. A rank whose readers run dry first
stops with an error naming the fix (a lower ``samples_per_epoch``).

Resume. Every batch carries its reader's cursor (its next unopened shard) and skip counts; ShardProgress (a
callback) records them, from all ranks, after each step, and the checkpoint keeps them (``ShardLoader.state_dict``).
A resumed run continues each reader at its cursor in the same epoch's permutation: samples of shards already
opened — the unread rest of a shard being read, the shuffle buffer — are dropped for that epoch, never read twice;
the epochs after it are exactly the uninterrupted run's.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmgeo.data.images import MAX_PIXELS
from mmgeo.data.shards import SHARD_STRIDE, SKIP_REASONS, ShardError, check_shard_count, decode_sample, read_shard


class ShardSource:
    """The train split of ``data.name: webdataset``: the shard list and what the training loop learns while it reads
    (each reader's cursor and skip counts, ``record``); ``skipped`` and ``len`` for the skipped-sample report."""

    def __init__(self, pattern: str | None, samples_per_epoch: int | None, shuffle_buffer: int = 1000,
                 max_pixels: int = MAX_PIXELS):
        from mmgeo.data.shards import expand_shards

        if not samples_per_epoch or samples_per_epoch < 1:
            raise ValueError("data.name: webdataset needs data.samples_per_epoch (samples per epoch, a fixed number "
                             "so that steps and checkpoints line up): set it a few shards below the number of "
                             "samples in data.shards")
        if shuffle_buffer < 0:
            raise ValueError(f"data.shuffle_buffer must be 0 (no shuffle) or more, got {shuffle_buffer}")
        self.pattern, self.urls = pattern, expand_shards(pattern or "")
        self.samples_per_epoch, self.shuffle_buffer, self.max_pixels = samples_per_epoch, shuffle_buffer, max_pixels
        self.cursors: dict[tuple[int, int], int] = {}  # (rank, worker) -> next unopened shard of its list
        self.counts: dict[tuple[int, int], list[int]] = {}  # (rank, worker) -> skip counts (SKIP_REASONS order)

    def __len__(self) -> int:
        return self.samples_per_epoch

    def begin_epoch(self, starts: dict) -> None:
        """Forget the last epoch's positions; ``starts``: {(rank, worker): (cursor, counts)} of a resumed epoch."""
        self.cursors = {k: v[0] for k, v in starts.items()}
        self.counts = {k: list(v[1]) for k, v in starts.items()}

    def record(self, rows: list[list[int]]) -> None:
        """Rows ``[rank, worker, cursor, *counts]`` of batches trained on (ShardProgress, after each step)."""
        for rank, worker, cursor, *counts in rows:
            self.cursors[(rank, worker)], self.counts[(rank, worker)] = cursor, counts

    @property
    def skipped(self) -> Counter:
        total = np.sum(list(self.counts.values()), axis=0) if self.counts else np.zeros(len(SKIP_REASONS), int)
        return Counter({k: int(n) for k, n in zip(SKIP_REASONS, total) if n})


def reader_shards(num_shards: int, seed: int, epoch: int, rank: int, world: int, worker: int, workers: int) -> list:
    """Shard numbers of one reader in epoch ``epoch``: split by node (rank), then by worker, of a (seed, epoch)
    permutation."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_shards)
    return [int(s) for s in perm[rank::world][worker::max(1, workers)]]


class ShardPairs(IterableDataset):
    """Collated local batches of one reader (see the module docstring); the loader sets ``epoch``, ``rank``,
    ``world``, ``workers`` and ``starts`` before each epoch, in the main process."""

    def __init__(self, source: ShardSource, pairs, collate, local_batch: int, seed: int):
        self.source, self.pairs, self.collate = source, pairs, collate
        self.local_batch, self.seed = local_batch, seed
        self.epoch, self.rank, self.world, self.workers, self.starts = 0, 0, 1, 0, {}

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        mine = reader_shards(len(self.source.urls), self.seed, self.epoch, self.rank, self.world, worker, self.workers)
        cursor, counts = self.starts.get((self.rank, worker), (0, [0] * len(SKIP_REASONS)))
        counts = list(counts)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker])
        state = {"cursor": cursor}

        def samples():
            while state["cursor"] < len(mine):
                shard = mine[state["cursor"]]
                state["cursor"] += 1
                errors = []
                for pos, sample in read_shard(self.source.urls[shard], errors):
                    image, captions, reason = decode_sample(sample, self.source.max_pixels)
                    if reason:
                        counts[SKIP_REASONS.index(reason)] += 1
                        continue
                    yield shard * SHARD_STRIDE + pos, image, captions
                counts[SKIP_REASONS.index("unreadable_shard")] += len(errors)

        batch = []
        for sample_id, image, captions in shuffled(samples(), self.source.shuffle_buffer, rng):
            batch.append(self.pairs.item([(image, captions)], sample_id, self.epoch, -1))
            if len(batch) == self.local_batch:
                out = self.collate(batch)
                out["reader"] = torch.tensor([self.rank, worker, state["cursor"], *counts])
                yield out
                batch = []


def shuffled(items, size: int, rng: np.random.Generator):
    """Items through a shuffle buffer of ``size`` (webdataset's ``shuffle``): once full, each new item replaces
    a random one, which is yielded; the rest in random order at the end. ``size`` ≤ 1: in order."""
    buf = []
    for item in items:
        if size <= 1:
            yield item
            continue
        if len(buf) < size:
            buf.append(item)
            continue
        j = int(rng.integers(size))
        yield buf[j]
        buf[j] = item
    for j in rng.permutation(len(buf)):
        yield buf[j]


def _as_is(batch):
    return batch


class ShardLoader(DataLoader):
    """The training loader of shards: ``steps_per_epoch`` local batches per epoch, stamped with their (epoch, global
    step); saved and restored with the checkpoint (Lightning's ``_Stateful`` protocol) as the readers' cursors.
    ``progress()`` is the trainer's global step."""

    def __init__(self, dataset: ShardPairs, global_batch: int, num_workers: int, progress=None):
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_as_is)
        self.global_batch, self.progress = global_batch, progress or (lambda: 0)
        self.steps_per_epoch = dataset.source.samples_per_epoch // global_batch
        if self.steps_per_epoch < 1:
            raise ValueError(f"data.samples_per_epoch={dataset.source.samples_per_epoch} is less than one global "
                             f"batch ({global_batch}); raise it or lower trainer.batch_size")
        self._resume: dict | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _identity(self) -> dict:
        ds = self.dataset
        return {"seed": ds.seed, "global_batch": self.global_batch, "samples_per_epoch": ds.source.samples_per_epoch,
                "shards": len(ds.source.urls)}

    def __iter__(self):
        from mmgeo.training.distributed import rank_and_world

        ds, spe = self.dataset, self.steps_per_epoch
        rank, world = rank_and_world()
        check_shard_count(len(ds.source.urls), world, self.num_workers, ds.source.pattern)
        step0 = self.progress()
        epoch, done = divmod(step0, spe)
        starts = {}
        if self._resume is not None and done:
            state, self._resume = self._resume, None
            if state["step"] != step0 or [state["world"], state["workers"]] != [world, self.num_workers]:
                raise ValueError(f"cannot resume the shard readers: the checkpoint has step {state['step']} on "
                                 f"{state['world']} rank(s) × {state['workers']} worker(s), this run step {step0} on "
                                 f"{world} × {self.num_workers}; resume with the run's own config")
            starts = {(r, w): (c, counts) for r, w, c, *counts in state["readers"]}
        elif done:
            raise RuntimeError(f"shard loader asked to start mid-epoch (step {step0}) without a resumed position")
        self._resume = None
        ds.source.begin_epoch(starts)
        ds.epoch, ds.rank, ds.world, ds.workers, ds.starts = epoch, rank, world, self.num_workers, starts
        it, n = super().__iter__(), 0
        try:
            for batch in it:
                batch["epoch"], batch["step"] = torch.tensor(epoch), torch.tensor(step0 + n)
                yield batch
                n += 1
                if done + n == spe:
                    return
        finally:
            del it  # stops the workers when the epoch ends before their shards do
        raise ShardError(f"rank {rank}'s shards ran dry in epoch {epoch} after {done + n} of {spe} steps: its "
                         f"readers' shards hold fewer good samples than data.samples_per_epoch / ranks = "
                         f"{ds.source.samples_per_epoch // world} (bad samples so far: {dict(ds.source.skipped)}); "
                         "lower data.samples_per_epoch")

    def state_dict(self) -> dict:
        """The position after ``progress()`` global steps: every reader's cursor and skip counts (all ranks)."""
        src = self.dataset.source
        readers = [[r, w, c, *src.counts.get((r, w), [0] * len(SKIP_REASONS))] for (r, w), c in src.cursors.items()]
        from mmgeo.training.distributed import rank_and_world

        return {**self._identity(), "step": self.progress(), "readers": sorted(readers),
                "world": rank_and_world()[1], "workers": self.num_workers}

    def load_state_dict(self, state: dict) -> None:
        mine = self._identity()
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"cannot resume this data order: the checkpoint was written with {theirs}, this run has "
                             f"{mine}; resume with the run's own config (runs/<name>/config.yaml)")
        self._resume = state
