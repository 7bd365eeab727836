"""Micro-batching: concurrent requests share encode calls, each gets its own row, errors reach every waiter."""

import asyncio
import threading

import pytest

from serve.batching import MicroBatcher


def test_concurrent_requests_are_batched_off_the_event_loop():
    calls, loop_thread = [], []

    def encode(texts):
        calls.append((list(texts), threading.current_thread()))
        return [t.upper() for t in texts]

    async def main():
        loop_thread.append(threading.current_thread())
        b = MicroBatcher(encode, max_batch=8, max_wait_ms=20)
        await b.start()
        out = await asyncio.gather(*(b.submit(f"q{i}") for i in range(20)))
        await b.stop()
        return out, b

    out, b = asyncio.run(main())
    assert out == [f"Q{i}" for i in range(20)]  # each waiter gets its own row, in order
    assert len(calls) < 20 and max(len(t) for t, _ in calls) == 8 and b.items == 20
    assert all(th is not loop_thread[0] for _, th in calls), "encode must run in a worker thread"


def test_an_encode_error_reaches_the_waiters_and_the_worker_survives():
    def encode(texts):
        if "boom" in texts:
            raise RuntimeError("encoder failed")
        return texts

    async def main():
        b = MicroBatcher(encode, max_batch=4, max_wait_ms=1)
        await b.start()
        with pytest.raises(RuntimeError, match="encoder failed"):
            await b.submit("boom")
        ok = await b.submit("fine")
        await b.stop()
        return ok

    assert asyncio.run(main()) == "fine"


def test_two_workers_run_two_batches_at_once():
    """While one batch is in its thread, the second worker gathers and runs the next one in parallel."""
    running, overlap = [0], [0]
    lock = threading.Lock()

    def slow(items):
        with lock:
            running[0] += 1
            overlap[0] = max(overlap[0], running[0])
        threading.Event().wait(0.2)
        with lock:
            running[0] -= 1
        return [i * 10 for i in items]

    async def main(workers):
        b = MicroBatcher(slow, max_batch=2, max_wait_ms=1, workers=workers)
        await b.start()
        out = await asyncio.gather(*(b.submit(i) for i in range(4)))
        await b.stop()
        return out

    assert asyncio.run(main(2)) == [0, 10, 20, 30] and overlap[0] == 2
    overlap[0] = 0
    assert asyncio.run(main(1)) == [0, 10, 20, 30] and overlap[0] == 1
    with pytest.raises(ValueError, match="workers must be at least 1"):
        MicroBatcher(slow, workers=0)
    with pytest.raises(ValueError, match="batch size must be at least 1"):
        MicroBatcher(slow, max_batch=0)


def test_what_queued_while_a_batch_ran_joins_the_next_one_even_without_a_wait():
    """max_wait_ms=0 still batches under load: the requests that queued up during a batch form the next one
    (a worker that only took one item per batch would run six batches here)."""
    sizes = []

    def slow(items):
        sizes.append(len(items))
        threading.Event().wait(0.1)
        return items

    async def main():
        b = MicroBatcher(slow, max_batch=8, max_wait_ms=0)
        await b.start()
        first = asyncio.ensure_future(b.submit(0))
        await asyncio.sleep(0.03)  # the first batch is running in its thread
        rest = await asyncio.gather(*(b.submit(i) for i in range(1, 6)))
        await b.stop()
        return [await first, *rest]

    assert asyncio.run(main()) == [0, 1, 2, 3, 4, 5]
    assert sizes == [1, 5]


def test_one_worker_gathers_at_a_time_so_light_load_is_not_split_in_two():
    """Two workers, four requests a few ms apart within one wait window: one batch of four, not two halves (each
    worker taking every other request would double the per-batch cost at moderate load); the second worker gathers
    only once the first has started its batch."""
    sizes = []

    def fn(items):
        sizes.append(len(items))
        return items

    async def main():
        b = MicroBatcher(fn, max_batch=8, max_wait_ms=200, workers=2)
        await b.start()
        async def later(i):
            await asyncio.sleep(0.005 * i)
            return await b.submit(i)

        out = await asyncio.gather(*(later(i) for i in range(4)))
        await b.stop()
        return out

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert sizes == [4]
