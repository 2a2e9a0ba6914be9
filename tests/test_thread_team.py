"""The OpenMP team of a thread that is done with model work is let go (``release_thread_team``).

libgomp keeps a team of helper threads for every thread that ran a parallel region on two or more threads. A server
loads its models on one thread and runs its passes on its worker: with the loading thread's team still alive there are
more threads than CPUs, libgomp throttles its spinning, and every barrier of a pass sleeps (a one-row pass of the
default target took 2.4 ms instead of 1.1). These tests count the process's threads (Linux: ``/proc/self/task``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdec.runtime.native_kernel import release_thread_team
from specdec.tune import _on_own_thread  # a thread of its own, which ends with the call

TASKS = Path("/proc/self/task")
pytestmark = pytest.mark.skipif(
    not TASKS.exists() or len(os.sched_getaffinity(0)) < 2, reason="counts threads in /proc; needs 2+ CPUs"
)


def _tasks() -> int:
    return len(os.listdir(TASKS))


def _settled(expected: int) -> int:
    """The thread count once it is ``expected``, or what it is after 5 s (released helpers exit on their own)."""
    deadline = time.monotonic() + 5.0
    while _tasks() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _tasks()


def _parallel_op() -> None:
    """A reduction big enough that torch runs it as an OpenMP parallel region on every thread it has."""
    x = torch.arange(8_000_000, dtype=torch.float32)
    assert float((x * 0.5).sum()) > 0


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_release_lets_the_threads_team_go(two_threads: None) -> None:
    def work() -> tuple[int, int, bool, int]:
        torch.set_num_threads(2)  # this thread's own setting (OpenMP's is per thread)
        before = _tasks()
        _parallel_op()
        with_team = _tasks()
        released = release_thread_team()
        return before, with_team, released, _settled(before)

    before, with_team, released, after = _on_own_thread(work)
    assert with_team == before + 1, "the parallel region made no team: nothing to test"
    assert released
    assert after == before


def test_load_lets_the_loading_threads_team_go(two_threads: None, tiny_models: dict[str, Path]) -> None:
    """``specdec.load`` ends with the loading thread's team let go, whatever ran on that thread before."""
    import specdec

    def work() -> tuple[int, int, int]:
        torch.set_num_threads(2)
        before = _tasks()
        _parallel_op()
        with_team = _tasks()
        specdec.load(tiny_models["llama"], tiny_models["draft"])
        return before, with_team, _settled(before)

    before, with_team, after = _on_own_thread(work)
    assert with_team == before + 1
    assert after == before, "the loading thread kept its OpenMP team"


def test_release_without_a_team_is_harmless() -> None:
    def work() -> tuple[bool, bool]:
        return release_thread_team(), release_thread_team()

    assert _on_own_thread(work) == (True, True)
