"""Micro-batching: requests wait a few ms on a queue and are processed together in a worker thread.

The event loop never runs the model: a worker task gathers up to ``max_batch`` items (waiting at most
``max_wait_ms`` after the first), runs ``fn(items) -> results`` (one result per item, e.g. encode the
texts in one call, then search them together) via ``asyncio.to_thread`` and hands every waiter its own
result. Requests already queued when a batch starts gathering join it at once (with ``max_wait_ms=0`` the batch
is what queued while the previous one ran). With ``workers`` > 1 several such tasks take turns: one gathers at a
time, so while one batch runs in its thread (torch and FAISS release the GIL) the next is gathered and run on
another core, but a moderate load is not split into half-size batches that each pay the per-batch cost (the
encoder's per-call work, the FAISS call): with each worker taking every other request the server spent 22-44 %
more CPU per request at 8 clients (docs/serve.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class MicroBatcher:
    """``await batcher.submit(item)`` -> ``fn([...items])[i]`` for this item's position ``i`` in its batch."""

    def __init__(self, fn: Callable, max_batch: int = 32, max_wait_ms: float = 3.0, workers: int = 1):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"batch size must be at least 1 and the wait at least 0 ms, got {max_batch} and "
                             f"{max_wait_ms}")
        self.fn, self.max_batch, self.max_wait, self.n_workers = fn, max_batch, max_wait_ms / 1000, workers
        self.queue: asyncio.Queue | None = None
        self.gathering: asyncio.Lock | None = None  # held by the worker that is gathering a batch
        self.workers: list[asyncio.Task] = []
        self.batches = 0  # batches run so far (for /metrics)
        self.items = 0

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.gathering = asyncio.Lock()
        self.workers = [asyncio.create_task(self._run()) for _ in range(self.n_workers)]

    async def stop(self) -> None:
        for w in self.workers:
            w.cancel()
            try:
                await w
            except asyncio.CancelledError:
                pass
        self.workers = []

    async def submit(self, item):
        if not self.workers:
            await self.start()
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((item, fut))
        return await fut

    async def _gather(self) -> list:
        batch = [await self.queue.get()]
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch and not self.queue.empty():  # what is queued already joins
            batch.append(self.queue.get_nowait())
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), left))
            except asyncio.TimeoutError:
                break
        return batch

    async def _run(self) -> None:
        while True:
            async with self.gathering:  # one worker gathers at a time; the next starts once this batch runs
                batch = await self._gather()
            batch = [(t, f) for t, f in batch if not f.done()]  # drop requests cancelled while queued
            if not batch:
                continue
            try:
                out = await asyncio.to_thread(self.fn, [t for t, _ in batch])
            except Exception as err:  # noqa: BLE001 - hand the error to every waiter, keep serving
                for _, f in batch:
                    if not f.done():
                        f.set_exception(err)
                continue
            self.batches, self.items = self.batches + 1, self.items + len(batch)
            for i, (_, f) in enumerate(batch):
                if not f.done():
                    f.set_result(out[i])
