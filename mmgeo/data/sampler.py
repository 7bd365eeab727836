"""A data order that survives restarts and spreads over ranks: global batches from a (seed, epoch) permutation.

Each epoch is a permutation of the N items drawn from ``(seed, epoch)``; step s of the epoch is the global
batch ``perm[s·G : (s+1)·G]`` (the last incomplete batch is dropped, so every step has G items); rank r of W
takes the contiguous slice ``[r·G/W, (r+1)·G/W)``. The W local batches in rank order are therefore exactly
the batch one process would see, and the order depends on nothing but (seed, epoch, step): resuming at
global step s continues with the same samples, none repeated, none skipped.

With ``neighbours`` (``mmgeo.data.caption_groups``) the epoch's permutation is regrouped into consecutive groups
of ``group`` caption neighbours (still a permutation drawn from ``(seed, epoch)``), so each rank's batch holds
whole groups when ``group`` divides it.

The sampler yields keys ``(item, epoch, step)`` — datasets use ``epoch`` for per-epoch choices (which
caption) and the training step checks ``step`` against its own counter.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler


class ResumableBatchSampler(Sampler):
    """Batch sampler of ``global_batch // world`` keys per step for this rank; ``state_dict`` /
    ``load_state_dict`` record and restore the position (epoch, global step)."""

    def __init__(self, num_items: int, global_batch: int, seed: int = 0, rank: int | None = None,
                 world: int | None = None, neighbours: np.ndarray | None = None, group: int = 1):
        if global_batch <= 0 or num_items < global_batch:
            raise ValueError(f"need at least one full global batch: {num_items} items, global batch {global_batch}; "
                             "lower trainer.batch_size or use more data")
        if neighbours is not None and (group < 2 or global_batch % group or len(neighbours) != num_items):
            raise ValueError(f"caption groups of {group} need group ≥ 2 dividing the global batch {global_batch} and "
                             f"one neighbour row per item ({len(neighbours)} rows, {num_items} items)")
        self.num_items, self.global_batch, self.seed = num_items, global_batch, seed
        self.neighbours, self.group = neighbours, group
        self._rank, self._world = rank, world
        self.epoch, self._resume_step = 0, None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.global_batch

    def _rank_world(self) -> tuple[int, int]:
        """Given at construction, else read from torch.distributed when iteration starts (after the launch)."""
        if self._rank is not None and self._world is not None:
            return self._rank, self._world
        from mmgeo.training.distributed import rank_and_world

        return rank_and_world()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> ResumableBatchSampler:
        """Lightning (like torch's BatchSampler protocol) calls ``batch_sampler.sampler.set_epoch(e)`` before
        each epoch; the epoch permutation lives here, so that is this object."""
        return self

    def permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.num_items)  # (N,)
        if self.neighbours is None:
            return perm
        from mmgeo.data.caption_groups import grouped_order

        return grouped_order(perm, self.neighbours, self.group, rng)  # (N,) groups of caption neighbours

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self):
        rank, world = self._rank_world()
        if self.global_batch % world:
            raise ValueError(f"global batch {self.global_batch} does not split over {world} ranks; "
                             f"make trainer.batch_size a multiple of devices × nodes")
        if self.neighbours is not None and (self.global_batch // world) % self.group:
            raise ValueError(f"caption groups of {self.group} do not fill a local batch of "
                             f"{self.global_batch // world}; make data.caption_groups divide "
                             "trainer.batch_size / (devices × nodes)")
        local, spe = self.global_batch // world, self.steps_per_epoch
        first = 0
        if self._resume_step is not None:
            first = self._resume_step - self.epoch * spe  # position inside the resumed epoch
            self._resume_step = None
            if not 0 <= first <= spe:
                raise ValueError(f"resume step lies outside epoch {self.epoch} ({spe} steps per epoch)")
        perm = self.permutation(self.epoch)
        for s in range(first, spe):
            batch = perm[s * self.global_batch:(s + 1) * self.global_batch][rank * local:(rank + 1) * local]
            yield [(int(i), self.epoch, self.epoch * spe + s) for i in batch]

    def state_dict(self, step: int) -> dict:
        """The position after ``step`` consumed global batches, plus what the order depends on."""
        state = {"step": step, "epoch": step // self.steps_per_epoch, "seed": self.seed,
                 "global_batch": self.global_batch, "num_items": self.num_items}
        return state if self.neighbours is None else {**state, "group": self.group}

    def load_state_dict(self, state: dict) -> None:
        mine = {"seed": self.seed, "global_batch": self.global_batch, "num_items": self.num_items}
        if self.neighbours is not None or "group" in state:
            mine["group"] = self.group if self.neighbours is not None else None
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"cannot resume this data order: the checkpoint was written with {theirs}, this run has "
                             f"{mine}; resume with the run's own config (runs/<name>/config.yaml)")
        self.epoch, self._resume_step = state["epoch"], state["step"]


class SampleLog:
    """samples.tsv: one line per step, ``step<TAB>epoch<TAB>i,j,...`` (global batch, rank order), written by
    rank 0 and flushed at once so that a killed run keeps every line. A resumed run appends: a step
    redone after a crash appears twice, the later line is the one that counted."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, step: int, epoch: int, index: torch.Tensor) -> None:
        from mmgeo.training.distributed import rank_and_world

        if rank_and_world()[0] == 0:
            with open(self.path, "a") as f:
                f.write(f"{step}\t{epoch}\t{','.join(map(str, index.tolist()))}\n")


def read_samples(path: str | os.PathLike) -> dict[int, tuple[int, list[int]]]:
    """samples.tsv -> {step: (epoch, items)}, the last line of each step winning (see SampleLog)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        step, epoch, items = line.split("\t")
        out[int(step)] = (int(epoch), [int(i) for i in items.split(",")])
    return out
