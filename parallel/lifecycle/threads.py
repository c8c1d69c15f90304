"""How many threads a CPU run computes with: one per core that other processes leave idle, so that a busy
neighbour (a browser, an indexer) costs the run about that neighbour's share of the cores. With two OpenMP
threads on two cores and one core taken, every parallel region waits for the thread the neighbour
displaced: the demo's step went from 0.15 s to 1.06 s beside `yes > /dev/null` (7x), 0.27 s with one
thread. OMP_NUM_THREADS wins; a count set lower in the process (the tests' workers) is never raised.
"""

import os
import time

import torch

SAMPLE_S = 0.2  # how long the cores' idle time is watched at start-up


def _cpu_times(cpus: set) -> tuple[int, int]:
    """(idle, total) jiffies of `cpus`, summed, from /proc/stat ((0, 0) where it cannot be read)."""
    idle = total = 0
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle, total = idle + values[3] + values[4], total + sum(values)
    return idle, total


def idle_cores(cpus: set, seconds: float = SAMPLE_S) -> float | None:
    """How many of `cpus` sat idle over `seconds` (this process sleeps meanwhile), or None unknown."""
    idle0, total0 = _cpu_times(cpus)
    time.sleep(seconds)
    idle1, total1 = _cpu_times(cpus)
    if total1 <= total0:
        return None
    return len(cpus) * (idle1 - idle0) / (total1 - total0)


def pick_cpu_threads() -> str:
    """Set torch's thread count for a CPU run (see the module docstring); the start-up line's words."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    had = torch.get_num_threads()  # torch's default: the physical cores
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{had} thread{'s' * (had > 1)} (OMP_NUM_THREADS)"
    idle = idle_cores(cpus) if had > 1 else None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # this host's ranks share its idle cores
    threads = had if idle is None else max(1, min(had, round(idle / local)))
    torch.set_num_threads(threads)
    busy = idle is not None and round(idle) < len(cpus)
    busy = f", as {len(cpus) - round(idle)} of {len(cpus)} cores are busy" if busy else ""
    return f"{threads} thread{'s' * (threads > 1)}{busy}"
