"""Process groups and devices for one run: started once by train.py / infer.py.

`torchrun` or plain `python` both work: without torchrun's environment this sets up a one-process
group on a free local port, so one code path (FSDP, distributed checkpoints) serves every run.
CUDA machines get NCCL and bf16; CPU machines get gloo and float32.
"""

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from parallel import comm
from parallel.layout import ParallelLayout
from parallel.sequence import SequenceGroups

NCCL_HINT = (
    "This is usually the transport, not tessera: on PCIe machines try NCCL_P2P_LEVEL=NVL (or NCCL_P2P_DISABLE=1), "
    "check that every node can reach MASTER_ADDR:MASTER_PORT, and run with NCCL_DEBUG=INFO to see which step stalls."
)


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    layout: ParallelLayout
    # FSDP shards over every rank that trains (dp x ulysses x ring): sequence-parallel ranks hold
    # partial gradients of the same samples, and FSDP's average over all of them is the dp mean.
    fsdp_mesh: object
    control_group: object  # gloo group with a long timeout, to fence long single-rank work
    sequence: SequenceGroups  # this rank's ulysses / ring / sequence-parallel groups

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    def fence(self) -> None:
        """Wait for every rank on the control group (gloo, long timeout): use around long work that
        one rank does alone, so the others do not sit in a collective with a short deadline."""
        comm.barrier(self.control_group)


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) for plain python."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    """Processes on this node (torchrun sets LOCAL_WORLD_SIZE); used by parallel.auto to keep ulysses in a node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no GPU: this node shows {torch.cuda.device_count()} "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most "
                             f"that many processes per node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_runtime(parallel_cfg, layout: ParallelLayout) -> Runtime:
    """Create the process groups for an already validated layout and run a preflight collective."""
    rank, world_size, local_rank = world_from_env()
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout.describe()} is for {layout.world_size} processes, not {world_size}")
    # Plain `python train.py` (no torchrun environment): a private one-process group on a free port.
    init_method = None if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{_free_port()}"
    device = pick_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm.configure(parallel_cfg.max_message_mb)

    # Start with the short preflight timeout: a transport that cannot connect shows up here, in seconds.
    preflight = datetime.timedelta(seconds=parallel_cfg.preflight_timeout_s)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=preflight,
                                device_id=device if device.type == "cuda" else None)
        probe = torch.ones(1, device=device)
        # Poll instead of blocking: on NCCL a hung transport would block .item() until the watchdog
        # kills the process from C++, and this message would never be printed.
        work = dist.all_reduce(probe, async_op=True)
        deadline = time.monotonic() + 0.9 * parallel_cfg.preflight_timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from every rank")
            time.sleep(0.01)
        if int(probe.item()) != world_size:
            raise RuntimeError(f"preflight all-reduce returned {probe.item()}, expected {world_size}")
    except Exception as e:
        raise RuntimeError(f"rank {rank}: the preflight all-reduce across {world_size} processes failed within "
                           f"{parallel_cfg.preflight_timeout_s:.0f}s ({e}). {NCCL_HINT}") from e
    _set_pg_timeout(datetime.timedelta(seconds=parallel_cfg.timeout_s))

    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=parallel_cfg.timeout_s)
    fsdp_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    # Groups made from a device mesh do not inherit the init timeout: set it explicitly.
    _set_pg_timeout(timeout, fsdp_mesh.get_group())
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=parallel_cfg.control_timeout_s))
    sequence = sequence_groups(layout, rank, timeout)
    return Runtime(rank, world_size, local_rank, device, backend, layout, fsdp_mesh, control, sequence)


def sequence_groups(layout: ParallelLayout, rank: int, timeout) -> SequenceGroups:
    """Every process creates every group, in the same order, from the layout's one rank generator."""
    def my_group(*axes):
        ranks = layout.group_of(rank, *axes)
        if len(ranks) == 1:
            return None, ranks
        group, _ = dist.new_subgroups_by_enumeration(layout.groups(*axes), timeout=timeout,
                                                     group_desc="+".join(axes))
        return group, ranks

    ulysses_group, ulysses_ranks = my_group("ulysses")
    ring_group, ring_ranks = my_group("ring")
    sp_group, sp_ranks = my_group("ulysses", "ring")
    return SequenceGroups(ulysses_group, len(ulysses_ranks), ulysses_ranks.index(rank), ring_group, ring_ranks,
                          ring_ranks.index(rank), sp_group, len(sp_ranks), sp_ranks.index(rank))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# Errors a user can fix from the message alone: printed without a traceback, exit code 2.
def _user_errors():
    from configs import ConfigError
    from models.attention import AttentionBackendUnavailable
    from parallel.checkpoint import CheckpointError
    from parallel.layout import LayoutError

    return (ConfigError, LayoutError, CheckpointError, AttentionBackendUnavailable, FileNotFoundError, ValueError)


class Terminated(BaseException):
    """SIGTERM, e.g. from torchrun stopping the survivors after one rank failed."""


def _terminate(signum, frame):
    raise Terminated(f"received signal {signum}")


def run_entrypoint(main, argv=None) -> int:
    """Run an entry point: a user error prints `error: ...` and exits 2 on every rank; any other
    failure, or SIGTERM, writes this rank's recent collectives to the run's failures/ folder first."""
    import signal
    import sys

    rank = world_from_env()[0]
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        main(argv)
        return 0
    except _user_errors() as e:
        if os.environ.get("TESSERA_DEBUG"):
            raise
        prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException as e:
        folder = comm.failure_dir()
        if folder is not None and dist.is_initialized() and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            path = comm.dump_records(folder, rank, repr(e))
            print(f"[rank {rank}] recent collectives written to {path}", file=sys.stderr, flush=True)
        if isinstance(e, Terminated):
            print(f"[rank {rank}] stopped: {e}", file=sys.stderr, flush=True)
            return 128 + signal.SIGTERM
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutdown()
