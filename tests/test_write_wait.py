"""The worker's wait for the event loop after a step (``scheduler.wait_written``, ``specdec serve --write-wait``):
it returns once the loops took the step's messages, gives up after its timeout on a loop that is busy, never hangs on
a closed one, and a scheduler with it starts no step while a request's messages of the step before still wait."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specdec.server.scheduler import Job, Scheduler, Step, wait_written

pytestmark = pytest.mark.server


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own, as the server's runs beside the worker."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    async def cancel_tasks() -> None:  # the readers and the hog, before the loop closes under them
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel_tasks(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _job(loop: asyncio.AbstractEventLoop, name: str) -> Job:
    async def make() -> Job:  # the queue belongs to the loop it is made on
        return Job(name, build=lambda engine: [], loop=loop, deadline=time.monotonic() + 60)

    return asyncio.run_coroutine_threadsafe(make(), loop).result(5)


def _consume(loop: asyncio.AbstractEventLoop, job: Job, taken: list[Any]) -> None:
    async def reader() -> None:
        while True:
            taken.append(await job.queue.get())

    loop.call_soon_threadsafe(lambda: loop.create_task(reader()))


def _message() -> Step:
    return Step(event=None, detail=None)  # type: ignore[arg-type]  # the wait looks at queues, not messages


def test_returns_once_the_loop_took_the_messages(loop: asyncio.AbstractEventLoop) -> None:
    jobs = [_job(loop, f"r{i}") for i in range(3)]
    taken: list[Any] = []
    for job in jobs:
        _consume(loop, job, taken)
    outbox = [(job, _message()) for job in jobs for _ in range(2)]
    from specdec.server.scheduler import post_all

    post_all(outbox)
    t0 = time.perf_counter()
    assert wait_written(outbox, timeout=5.0)
    assert time.perf_counter() - t0 < 2.0
    assert len(taken) == 6 and all(job.queue.empty() for job in jobs)


def test_gives_up_after_its_timeout_on_a_busy_loop(loop: asyncio.AbstractEventLoop) -> None:
    jobs = [_job(loop, f"r{i}") for i in range(2)]
    loop.call_soon_threadsafe(time.sleep, 0.6)  # the loop busy with something else for 0.6 s
    outbox = [(job, _message()) for job in jobs]
    from specdec.server.scheduler import post_all

    post_all(outbox)
    t0 = time.perf_counter()
    assert not wait_written(outbox, timeout=0.05)
    assert time.perf_counter() - t0 < 0.5  # the timeout, not the loop's 0.6 s
    time.sleep(0.7)  # the loop's check then runs once past its deadline and stops (no callback left spinning)
    assert len(loop._ready) == 0  # type: ignore[attr-defined]


def test_a_closed_loop_does_not_hold_the_worker() -> None:
    closed = asyncio.new_event_loop()
    job = Job("gone", build=lambda engine: [], loop=closed, deadline=time.monotonic() + 60)
    closed.close()
    t0 = time.perf_counter()
    assert wait_written([(job, _message())], timeout=5.0)
    assert time.perf_counter() - t0 < 1.0


def test_the_scheduler_starts_no_step_before_the_loop_took_the_last_ones(
    tiny_models: dict[str, Path], loop: asyncio.AbstractEventLoop
) -> None:
    """Three streamed requests on a loop that is busy most of the time (5 ms blocked, then a turn): with the wait,
    every step starts with every request's queue empty (its messages of the step before taken); without it
    (``write_wait=0``) steps start while messages still wait, so the check can fail."""
    import specdec

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"])

    async def hog() -> None:
        while True:
            time.sleep(0.005)
            await asyncio.sleep(0)

    def left_waiting(write_wait: float) -> int:
        scheduler = Scheduler(engine, max_batch=4, write_wait=write_wait)
        jobs: list[Job] = []
        waiting = [0]
        before = [0]  # sequences of the step before (a step streaming to one request is not waited for)
        step = engine.step

        def checked_step(gens: list[Any]) -> Any:
            if before[0] > 1:
                waiting[0] += sum(job.queue.qsize() for job in jobs)
            before[0] = len(gens)
            return step(gens)

        engine.step = checked_step  # type: ignore[method-assign]
        try:
            for i in range(3):
                job = _job(loop, f"r{i}")
                job.build = lambda eng, i=i: [eng.start(f"prompt {i}", max_new_tokens=24, tau=2, ignore_eos=True)]
                jobs.append(job)
            taken: list[Any] = []
            for job in jobs:
                _consume(loop, job, taken)
            for job in jobs:
                scheduler.submit(job)
            deadline = time.monotonic() + 60
            while not all(job.finished for job in jobs) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(job.finished for job in jobs)
        finally:
            scheduler.stop()
            del engine.step
        return waiting[0]

    task = asyncio.run_coroutine_threadsafe(hog(), loop)
    try:
        assert left_waiting(write_wait=5.0) == 0
        assert left_waiting(write_wait=0.0) > 0
    finally:
        task.cancel()


def test_the_setting_is_checked_and_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, the wait is 3 ms where the passes run on the CPU on every CPU the process may use, and 0 where the event
    loop has a core of its own or the passes run elsewhere; a value set is taken as it is."""
    from types import SimpleNamespace

    from specdec.errors import InvalidRequestError
    from specdec.runtime import cpu, native_kernel
    from specdec.server import ServerSettings
    from specdec.server.scheduler import write_wait_for

    assert ServerSettings().write_wait_ms is None and ServerSettings(write_wait_ms=0).write_wait_ms == 0
    with pytest.raises(InvalidRequestError, match="write_wait_ms=-1"):
        ServerSettings(write_wait_ms=-1)
    with pytest.raises(ValueError, match="write_wait"):
        Scheduler(None, write_wait=-0.001)  # type: ignore[arg-type]

    def engine(device: str) -> Any:
        return SimpleNamespace(target=SimpleNamespace(runner=SimpleNamespace(device=device)))

    monkeypatch.setattr(cpu, "usable_cpus", lambda: 2)
    monkeypatch.setattr(native_kernel, "pass_threads", lambda: 2)
    assert write_wait_for(engine("cpu"), None) == pytest.approx(0.003)
    assert write_wait_for(engine("cuda:0"), None) == 0.0
    assert write_wait_for(engine("cpu"), 0) == 0.0 and write_wait_for(engine("cuda:0"), 5) == pytest.approx(0.005)
    monkeypatch.setattr(cpu, "usable_cpus", lambda: 8)  # a core left for the event loop
    assert write_wait_for(engine("cpu"), None) == 0.0


def test_health_says_what_the_wait_is(tiny_models: dict[str, Path]) -> None:
    import httpx

    import specdec
    from specdec.server import ServerSettings, create_app

    engine = specdec.load(tiny_models["llama"], tiny_models["draft"])
    for ms, shown in ((0.0, 0.0), (2.5, 2.5)):
        app = create_app(engine, ServerSettings(model_name="tiny", write_wait_ms=ms))

        async def health(app: Any = app) -> Any:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return (await client.get("/health")).json()

        try:
            assert asyncio.run(health())["write_wait_ms"] == pytest.approx(shown)
        finally:
            app.state.scheduler.stop()
