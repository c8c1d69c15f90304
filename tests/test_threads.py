"""A CPU run's thread count (parallel/lifecycle/threads.py): one per core other processes leave idle, never
more than the process had, OMP_NUM_THREADS untouched; the cores' idle time read from /proc/stat."""

import os
import subprocess
import sys
import time

import pytest
import torch

from parallel.lifecycle import threads


@pytest.fixture
def restore_threads():
    had = torch.get_num_threads()
    yield
    torch.set_num_threads(had)


def test_one_thread_per_idle_core_and_never_more_than_it_had(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    torch.set_num_threads(4)
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 2.8)  # about one core taken by a neighbour
    assert threads.pick_cpu_threads() == "3 threads, as 1 of 4 cores are busy"
    assert torch.get_num_threads() == 3
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: 3.9)  # quiet: as many as it had
    torch.set_num_threads(4)
    assert threads.pick_cpu_threads() == "4 threads" and torch.get_num_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this host share its idle cores
    torch.set_num_threads(4)
    assert threads.pick_cpu_threads() == "2 threads" and torch.get_num_threads() == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    torch.set_num_threads(1)  # the tests' workers: never raised, and no cores watched
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: pytest.fail("watched with one thread"))
    assert threads.pick_cpu_threads() == "1 thread"


def test_omp_num_threads_wins(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "idle_cores", lambda cpus: pytest.fail("OMP_NUM_THREADS is the user's"))
    assert threads.pick_cpu_threads() == "2 threads (OMP_NUM_THREADS)" and torch.get_num_threads() == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_a_busy_core_is_seen_busy():
    """A process spinning on core 0 (pinned there): core 0 reads busy, its idle share near 0."""
    code = "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"
    spin = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)
        idle = threads.idle_cores({0}, seconds=0.5)
    finally:
        spin.kill()
    assert idle is not None and idle < 0.3, idle
