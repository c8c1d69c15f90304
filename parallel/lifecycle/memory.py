"""The memory a host has, and a watch on it during a training run.

`host_memory` reads what is available: the host's MemAvailable, or a memory cgroup's limit less what it
uses (a container's, a SLURM job's), whichever leaves less. The watchdog thread
(parallel/lifecycle/watchdog.py) asks `HostMemoryWatch.check` every quarter second: under a floor (5%, 768 MiB
to 4 GiB) it names the rank and the part that grew since the first step (its main process or its data loader
workers), for the watchdog to end the run before the kernel's out-of-memory killer ends a process with no line
at all. The start-up check of a recipe's modelled peak is parallel/lifecycle/memory_plan.py.
"""

import functools
import os
import socket
import sys
import time
from pathlib import Path

GiB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


# ---------------------------------------------------------------------------------------------------------
# What a host has


def _meminfo() -> dict:
    values = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return values


@functools.lru_cache(maxsize=1)
def _cgroup_dirs() -> list:
    """(version, folder) of this process's memory cgroups, and every ancestor up to the mount: a limit may
    be set on any of them (a container's, a SLURM job's). Read once: the watch asks four times a second."""
    mounts = {}
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            before, _, after = line.partition(" - ")
            fstype, _, options = (after.split() + ["", "", ""])[:3]
            point = before.split()[4]
            if fstype == "cgroup2":
                mounts.setdefault("v2", Path(point))
            elif fstype == "cgroup" and "memory" in options.split(","):
                mounts.setdefault("v1", Path(point))
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except (OSError, IndexError):
        return []
    found = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if number == "0" else "v1" if "memory" in controllers.split(",") else None
        if version is None or version not in mounts:
            continue
        folder = mounts[version] / path.lstrip("/")
        while True:
            if folder.is_dir():
                found.append((version, folder))
            if folder == mounts[version]:
                break
            folder = folder.parent
    return found


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_limits() -> list:
    """(limit, in use (reclaimable file pages not counted), where) of each memory cgroup with a limit."""
    limits = []
    for version, folder in _cgroup_dirs():
        if version == "v1":
            limit = _read_number(folder / "memory.limit_in_bytes")
            usage = _read_number(folder / "memory.usage_in_bytes")
            cache = sum(_stat(folder / "memory.stat", f"total_{k}") for k in ("inactive_file", "active_file"))
        else:
            limit = _read_number(folder / "memory.max")
            usage = _read_number(folder / "memory.current")
            cache = sum(_stat(folder / "memory.stat", k) for k in ("inactive_file", "active_file"))
        if limit is not None and usage is not None and limit < (1 << 60):  # file pages are reclaimed first
            limits.append((limit, max(0, usage - cache), f"cgroup {folder}"))
    return limits


def _simulated_limit() -> list:
    """TESSERA_HOST_MEMORY_MB (the tests, where no cgroup can be made): a host of that size holding this
    process and its children alone."""
    size = os.environ.get("TESSERA_HOST_MEMORY_MB")
    if not size:
        return []
    pid = os.getpid()
    used = rss(pid) + sum(rss(child) for child in children(pid))
    return [(int(float(size) * (1 << 20)), used, "TESSERA_HOST_MEMORY_MB")]


def host_memory() -> tuple[int, int, str]:
    """(bytes available, bytes in all, what sets them): the host's MemAvailable, or a cgroup's limit less
    what it uses, whichever leaves less."""
    info = _meminfo()
    available, total = info.get("MemAvailable", 0), info.get("MemTotal", 0)
    where = f"host {socket.gethostname()}"
    for limit, used, what in _cgroup_limits() + _simulated_limit():
        if limit - used < available or not total:
            available, total, where = max(0, limit - used), limit, what
    return available, total, where


def rss(pid: int) -> int:
    """Resident bytes of process `pid` (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def children(pid: int) -> list[int]:
    """The child processes of `pid` (its data loader workers)."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        pass
    return found


# ---------------------------------------------------------------------------------------------------------
# During the run


def floor_of(total: int) -> int:
    """What must stay available: 5% of the host (or cgroup), at least 768 MiB, at most 4 GiB."""
    return min(4 << 30, max(768 << 20, total // 20))


class HostMemoryWatch:
    """Asked by the watchdog thread: when the host's available memory falls under its floor and this rank
    grew since the watch began (its main process or its loader workers, by at least GROWTH), names that
    part for the watchdog to end the run with, before the out-of-memory killer acts. Low memory that this
    rank did not take (another job on the node) is said once, as a warning: stopping would not give it
    back."""

    GROWTH = 512 << 20

    def __init__(self, rank: int, every_s: float = 0.25, probe=host_memory, say=None):
        self.rank, self.every_s, self.probe = rank, every_s, probe
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.pid = os.getpid()
        self.base: dict | None = None
        self.base_step: int | None = None
        self._last, self._warned = 0.0, False

    def parts(self) -> dict:
        return {"main process": rss(self.pid), "data loader workers": sum(rss(c) for c in children(self.pid))}

    def begin(self, step: int) -> None:
        """The baseline: what each part holds at `step` (the first step of the loop)."""
        self.base, self.base_step = self.parts(), step

    def check(self, step: int | None) -> str | None:
        now = time.monotonic()
        if self.base is None or now - self._last < self.every_s:
            return None
        self._last = now
        available, total, where = self.probe()
        if not total or available >= floor_of(total):
            return None
        parts = self.parts()
        grown = {name: parts[name] - self.base[name] for name in parts}
        part = max(grown, key=grown.get)
        low = f"host memory nearly exhausted ({where}: {gib(available)} available of {gib(total)})"
        held = f"its main process holds {gib(parts['main process'])}, its loader workers "
        held += gib(parts["data loader workers"])
        if grown[part] < self.GROWTH:  # the part it would name: another shrinking hides no leak
            if not self._warned:
                self._warned = True
                since = f"rank {self.rank} did not grow since step {self.base_step}"
                self.say(
                    f"[tessera] warning: {low}, and {since} ({held}): another process takes it; the kernel's "
                    "out-of-memory killer may end one"
                )
            return None
        hint = {
            "data loader workers": "a dataset or transform that keeps what it loads, or more "
            "data.num_workers than this host holds",
            "main process": "the training process itself kept growing (a cache, a list of tensors)",
        }[part]
        return (
            f"{low}: rank {self.rank}'s {part} grew from {gib(self.base[part])} to {gib(parts[part])} since "
            f"step {self.base_step} ({hint}); stopped before the kernel's out-of-memory killer ends a "
            f"process without a word. {held[0].upper()}{held[1:]}"
        )
