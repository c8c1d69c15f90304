"""What the benchmarks in scripts/ share: the tiny switch, timing, markdown tables, JSON output and
launching a script's own workers under torchrun.

Scripts run as `python scripts/x.py`, so `import benchlib` finds this file; tests put scripts/ on
sys.path first. Only the standard library at import time (torch is imported where a function needs it).

The tiny switch, one convention for every benchmark: `--tiny`, or TESSERA_TINY=1 in the environment,
runs the script at tiny sizes on CPU in seconds: a check that it still works (tests/test_scripts.py
runs each one), never a figure to quote. An option given on the command line keeps its value.
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_ENV = "TESSERA_TINY"


def parser(doc: str, json_output: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the module docstring as its help, --tiny and (unless json_output=False)
    --json FILE."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tiny",
        action="store_true",
        default=os.environ.get(TINY_ENV) == "1",
        help=f"tiny sizes on CPU, in seconds (also {TINY_ENV}=1): checks that the script runs; not a figure",
    )
    if json_output:
        p.add_argument("--json", metavar="FILE", default=None, help="also write the results here")
    return p


def parse_args(p: argparse.ArgumentParser, argv=None, tiny: dict | None = None) -> argparse.Namespace:
    """Parse argv; with --tiny, the `tiny` values replace the defaults of the options they name (options
    given on the command line keep their values)."""
    if tiny and p.parse_known_args(argv)[0].tiny:
        p.set_defaults(**tiny)
    return p.parse_args(argv)


@dataclass
class Timing:
    """Seconds of each timed call: wall clock and CPU time of the whole process (all its threads)."""

    wall: list[float]
    cpu: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def min(self) -> float:
        return min(self.wall)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def measure(
    fn: Callable[[], object],
    repeats: int = 3,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> Timing:
    """fn() `warmup` times untimed, then `repeats` times timed. `before` runs ahead of each timed call,
    off the clock (a barrier, so that every rank starts together); `after` runs on the clock after each
    call, warm-ups included (a CUDA synchronize, so that queued kernels count)."""
    for _ in range(warmup):
        fn()
        if after:
            after()
    wall, cpu = [], []
    for _ in range(repeats):
        if before:
            before()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        if after:
            after()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return Timing(wall, cpu)


def cuda_sync() -> Callable[[], None] | None:
    """torch.cuda.synchronize when CUDA is there, else None (for measure's `after`)."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else None


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; cells are printed with str()."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in lines)


def machine() -> dict:
    """Where the figures were measured: the device, the software, how busy the machine was."""
    import torch

    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"{len(os.sched_getaffinity(0))}-core CPU ({platform.processor() or platform.machine()})"
    )
    return {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "load_average": round(os.getloadavg()[0], 2),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def write_json(path, results: dict) -> None:
    """results, with the machine() they were measured on, as indented JSON (dataclasses as dicts)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"machine": machine(), **results},
            indent=1,
            default=lambda o: asdict(o) if is_dataclass(o) else str(o),
        )
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, script, args: list[str]) -> list[str]:
    """`torchrun --standalone --nproc_per_node nproc script args`, through this Python."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


def torchrun(nproc: int, script, args: list[str], threads: int = 1, timeout: float | None = None) -> None:
    """Run a script's workers under torchrun from the repository root, `threads` OpenMP threads each;
    a failure ends the caller with the launch's last output."""
    done = subprocess.run(
        torchrun_command(nproc, script, args),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        raise SystemExit(
            f"torchrun with {nproc} processes failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
        )


class _Unwritten(io.TextIOBase):
    """`stream` without its "[tessera] wrote <file>" lines, each other line passed on as it ends."""

    def __init__(self, stream):
        self.stream, self.line = stream, ""

    def write(self, text: str) -> int:
        *done, self.line = (self.line + text).split("\n")
        for line in done:
            if not line.startswith("[tessera] wrote "):
                self.stream.write(line + "\n")
        self.stream.flush()
        return len(text)


def infer_videos(argv: list, count: int, session=None, walk=None):
    """The `count` videos ((count, T, H, W, 3) float32 in [0, 1]) infer.py samples for `argv` (its flags
    and overrides, no --output), read back from its unquantised .npy files in a folder that goes with them;
    its lines pass through as they come, but for those naming the files. `walk`: infer.main's. Its process
    group, watchdog and lock are closed after it, so that a script may sample again."""
    import numpy as np

    import infer
    from parallel.lifecycle.entrypoint import Session

    session = session or Session()
    with tempfile.TemporaryDirectory(prefix="tessera_infer_") as folder:
        output = str(Path(folder) / "clip.npy")
        with contextlib.redirect_stdout(_Unwritten(sys.stdout)):
            infer.main([*map(str, argv), "--output", output], session, walk=walk)
        session.close()  # a failure above keeps them: the entry point reports it with them
        session.run_dir = session.comm = session.watchdog = None
        return np.stack([np.load(path) for path in infer.output_paths(output, count)])
