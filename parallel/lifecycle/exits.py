"""How a failing process speaks and ends: its one-line messages, the hint for a stuck transport, and
an exit that does not wait on children or communicators. Shared by the entry point and the watchdog
thread; nothing here holds state.
"""

import os
import re
import sys
import threading
from pathlib import Path

import torch.distributed as dist

NCCL_HINT = (
    "This is usually the transport, not tessera: on PCIe machines try NCCL_P2P_LEVEL=NVL (or "
    "NCCL_P2P_DISABLE=1), check that every node can reach MASTER_ADDR:MASTER_PORT, and run with "
    "NCCL_DEBUG=INFO to see which step stalls."
)

# Errors that mean "a collective failed", most often because of another rank: the watchdog is asked
# who, before anything is printed. (Not plain "timed out": a DataLoader timeout is this rank's own.)
PEER_ERROR_WORDS = (
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "gloo",
    "nccl",
)


def error_message(error: BaseException) -> str:
    """The message of `error`; for one re-raised from a DataLoader worker, the worker's own error
    (its last line) rather than the wrapper and the worker's traceback."""
    message = str(error)
    if "Original Traceback" in message:
        last = [line for line in message.splitlines() if line.strip()][-1]
        return re.sub(r"^[\w.]*(Error|Exception): ", "", last)
    return message


def one_line(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error_message(error)}".split())
    return text if len(text) <= 400 else text[:397] + "..."


def is_peer_error(error: BaseException) -> bool:
    """Whether `error` is a failed collective or store call, likely caused by another rank."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in PEER_ERROR_WORDS)


def latest_checkpoint(run_dir) -> str:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    try:
        return str(pointer.parent / pointer.read_text().strip())
    except OSError:
        return "none yet (this run starts from scratch again)"


def dump_nccl_trace(folder: Path, rank: int, backend: str) -> None:
    """On NCCL, PyTorch's flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE, set by the runtime) holds
    every collective of every group with its state: write it beside the comm layer's records."""
    if backend != "nccl":
        return
    try:
        import torch

        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace  # renamed in 2.x
        (Path(folder) / f"nccl_trace_rank{rank}.pkl").write_bytes(dump())
    except Exception:
        pass


def print_line(line: str) -> None:
    """An error line on a line of its own: a progress bar's unfinished line (tqdm) is ended first, and the
    bars are silenced so that closing them later does not draw them again below the error. Ranks share
    one terminal and only rank 0 draws a bar, so the other ranks start their line with a newline."""
    bars = []
    try:
        from tqdm import tqdm

        bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if not bar.disable]
        for bar in bars:
            bar.disable = True
    except Exception:
        pass
    others_bar = int(os.environ.get("WORLD_SIZE", 1)) > 1 and int(os.environ.get("RANK", 0)) != 0
    print(("\n" if bars or others_bar else "") + line, file=sys.stderr, flush=True)


def hard_exit(code: int, backend: str) -> None:
    """End the process now, from any thread, with its child processes (DataLoader workers). The main
    thread may be blocked inside a collective: on NCCL the communicators are aborted first so that no
    kernel stays blocked on the GPU; on gloo the process exit closes the sockets, which wakes the peers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:  # DataLoader workers ignore stop signals (their parent owns them) and would outlive it by seconds
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
    except Exception:
        pass
    if backend == "nccl":
        threading.Timer(10.0, os._exit, args=(code,)).start()  # an abort that hangs must not keep us here
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception:
            pass
    os._exit(code)


def leave_finished(code: int | None = 0) -> None:
    """End a multi-process script whose work is done and whose process groups are destroyed: flush, then
    os._exit, skipping interpreter finalization. There gloo's worker threads may still be freeing a
    finished collective's tensors, which takes the GIL; a thread that takes it while the interpreter
    finalizes aborts the process ("terminate called without an active exception", SIGABRT after a
    successful run; seen in CI, 4 of 30 runs of tests/init_worker.py; pytorch/pytorch#179291)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)  # a main that returns None succeeded
