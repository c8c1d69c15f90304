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
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from configs.runlock import RunDirectoryInUse, RunLock, live_holder, owns
from parallel.compute import comm
from parallel.compute.cfg import SamplingGroups
from parallel.compute.layout import DEGREES, LayoutError, ParallelLayout
from parallel.compute.sequence import SequenceGroups
from parallel.lifecycle import faults
from parallel.lifecycle.exits import NCCL_HINT
from parallel.lifecycle.memory import HostMemoryWatch
from parallel.lifecycle.preemption import StopRequest
from parallel.lifecycle.rendezvous import connect_store, rendezvous
from parallel.lifecycle.threads import pick_cpu_threads
from parallel.lifecycle.watchdog import Deadlines, Watchdog


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
    watchdog: Watchdog  # heartbeats, stall detection and the shared abort (parallel/lifecycle/watchdog.py)
    stop: StopRequest  # stop signals, agreed at step boundaries (parallel/lifecycle/preemption.py)
    comm: comm.CommLog  # the record of this runtime's ops, read by the watchdog and failure dumps
    faults: faults.Faults  # what tests asked to go wrong (TESSERA_FAULT), read once at start-up
    sampling: SamplingGroups | None = (
        None  # cfg / PipeFusion groups and the replica (parallel/compute/pipefusion.py)
    )
    lock: RunLock | None = None  # rank 0 of a training run: the run directory's (configs/runlock.py)
    run_dir: Path | None = None
    lock_token: str | None = None  # every rank of a training run: the token of rank 0's lock
    threads: str = ""  # a CPU run's compute threads, in the start-up line's words (threads.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def holds_directory(self) -> bool:
        """Whether this run still owns its run directory (always, for a run that takes no lock): rank 0
        asks its lock, the other ranks read it (configs/runlock.py)."""
        return owns(self.lock, self.run_dir, self.lock_token)

    def ensure_directory(self) -> None:
        """Raise RunDirectoryInUse if another run took the run directory over: called before each write
        there (checkpoints, metrics, previews, reports), so a run that was frozen while it was taken over
        writes nothing more."""
        if self.lock is not None:
            self.lock.ensure_held()
        elif not self.holds_directory():
            raise RunDirectoryInUse(
                f"this run lost {Path(self.run_dir) / 'run.lock'} while it was silent (stopped, suspended "
                "or frozen): another run took the directory over; this rank writes nothing more there"
            )

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    def bf16(self, precision: str) -> bool:
        """Whether train.precision computes in bf16 on this device (computes_in_bf16)."""
        return computes_in_bf16(precision, self.device.type)

    def fence(self) -> None:
        """Wait for every rank on the control group (gloo, long timeout): use around long work that
        one rank does alone, so the others do not sit in a collective with a short deadline."""
        comm.barrier(self.control_group)

    def agreed_stop_signal(self) -> int:
        """0, or the stop signal (SIGTERM, SIGUSR1, SIGINT) that any rank received: one tiny all-reduce
        on the gloo control group, so every rank gets the same answer after the same step."""
        flag = torch.tensor([self.stop.signum], dtype=torch.int32)
        if self.world_size > 1:
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        return int(flag.item())


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) for plain python."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def local_world_size() -> int:
    """Processes on this node (torchrun sets LOCAL_WORLD_SIZE); used by parallel.auto to keep ulysses in a
    node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def links_are_slow() -> tuple[bool, str]:
    """Whether the GPUs inside a node lack NVLink (PCIe only), and a description of the links for the
    layout line: parallel.auto then gives PipeFusion, not ring, the axis that ulysses leaves (between
    nodes PipeFusion is chosen anyway). Read before any process group exists; NVLink is looked up
    through NVML when it is installed."""
    world, local = int(os.environ.get("WORLD_SIZE", 1)), local_world_size()
    nodes = f"{max(1, world // max(local, 1))} node(s) of {local} process(es)"
    if not torch.cuda.is_available():
        return False, f"{nodes}, no GPU"
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(os.environ.get("LOCAL_RANK", 0))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if (
            index < len(visible) and visible[index].strip().isdigit()
        ):  # NVML counts every GPU, not the visible ones
            index = int(visible[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for link in range(18):  # NVML_NVLINK_MAX_LINKS
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link):
                    return False, f"{nodes}, NVLink"
            except pynvml.NVMLError:
                break
        return True, f"{nodes}, GPUs without NVLink (PCIe)"
    except Exception:  # no NVML: assume the usual NVLink server
        return False, f"{nodes}, NVLink assumed (pynvml is not installed)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def computes_in_bf16(precision: str, device_type: str) -> bool:
    """Whether train.precision (bf16 | fp32 | auto: bf16 on a GPU) computes in bf16 on a `device_type`."""
    return precision == "bf16" or (precision == "auto" and device_type == "cuda")


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local_rank} has no GPU: this node shows {torch.cuda.device_count()} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most "
                f"that many processes per node"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def deadlines(parallel_cfg, device_type: str) -> Deadlines:
    stall = parallel_cfg.stall_timeout_s
    if stall is None:  # minutes on GPU (a 14B step at 32k tokens takes tens of seconds); CPU runs are small
        stall = 300.0 if device_type == "cuda" else 120.0
    return Deadlines(
        long_s=parallel_cfg.timeout_s,
        stall_s=min(stall, parallel_cfg.timeout_s),
        silence_s=parallel_cfg.heartbeat_timeout_s,
        save_s=max(parallel_cfg.timeout_s, parallel_cfg.control_timeout_s),
    )


def init_runtime(
    parallel_cfg, layout: ParallelLayout, run_dir=None, task: str = "train", session=None
) -> Runtime:
    """Create the process groups for an already validated layout, run a preflight collective and start
    the watchdog (heartbeats in `run_dir`'s name; failures written to run_dir/failures). `task` (train,
    sample, encode) words its messages: only training has checkpoints to resume from, and only training
    takes the run directory's lock (configs/runlock.py). `session` (from run_entrypoint,
    parallel/lifecycle/entrypoint.py) gets the run directory, the comm log, the watchdog and the lock as each
    comes to exist, so that a failure's report can reach them."""
    rank, world_size, local_rank = world_from_env()
    injected = faults.Faults.from_env(rank)  # tests only (TESSERA_FAULT): a malformed spec fails here
    if layout.world_size != world_size:
        raise ValueError(f"layout {layout.describe()} is for {layout.world_size} processes, not {world_size}")
    # Plain `python train.py` (no torchrun environment): a private one-process group on a free port.
    init_method = None if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{_free_port()}"
    device = pick_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    log = comm.CommLog(parallel_cfg.max_message_mb)
    stop = session.stop if session is not None else StopRequest()
    if session is not None:  # from here on a failure's report finds the run's folder and records
        session.run_dir, session.comm = run_dir, log
    if backend == "nccl" and run_dir is not None:
        _flight_recorder(Path(run_dir) / "failures")
    limits = deadlines(parallel_cfg, device.type)
    watch = (rank, world_size, run_dir, limits, backend, task, log, stop, session)
    injected.before_start("prestart")  # tests only: a rank that dies before its first heartbeat
    # torchrun's agent runs the store before any process group exists: the heartbeats start first, so a
    # rank that dies while the group forms is named within parallel.heartbeat_timeout_s. (gloo's and NCCL's
    # connect wait in C++ for their timeout, deaf to the SIGTERM torchrun sends when a rank dies.)
    early = world_size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if early:
        monitor = _start_watchdog(*watch)
        lock, token = rendezvous(monitor, run_dir, parallel_cfg.preflight_timeout_s, injected, session)
    _init_process_group(backend, init_method, rank, world_size, device, parallel_cfg.preflight_timeout_s)
    if not early:  # another launcher: rank 0 hosts the store, made with the process group
        monitor = _start_watchdog(*watch)
        lock, token = rendezvous(monitor, run_dir, parallel_cfg.preflight_timeout_s, injected, session)
    monitor.mark("start-up")
    log.adopt(None)  # from the first collective on, the default group's ops are this runtime's
    _set_pg_timeout(datetime.timedelta(seconds=parallel_cfg.timeout_s))
    _check_same_layout(layout, rank, world_size, device)
    fsdp_mesh, control, sequence, sampling = _make_groups(parallel_cfg, layout, rank, world_size, device, log)
    # A run that trains in this directory owns its failure records: sampling it leaves them alone.
    if rank == 0 and run_dir is not None and (task == "train" or live_holder(run_dir) is None):
        _archive_failures(Path(run_dir) / "failures")
    if rank == 0:
        print(f"[tessera] {limits.describe()}", flush=True)
    runtime = Runtime(
        rank,
        world_size,
        local_rank,
        device,
        backend,
        layout,
        fsdp_mesh,
        control,
        sequence,
        monitor,
        stop,
        log,
        injected,
        sampling,
        lock,
        Path(run_dir) if run_dir is not None else None,
        token,
    )
    monitor.may_write = runtime.holds_directory  # failure records only while the directory is this run's
    if task == "train":  # the host's memory, watched from the first step on (parallel/lifecycle/memory.py)
        monitor.memory = HostMemoryWatch(rank)
    if device.type == "cpu":
        runtime.threads = pick_cpu_threads()
    injected.at_startup()
    return runtime


def _flight_recorder(failures: Path) -> None:
    """PyTorch's flight recorder: every NCCL collective of every group, dumped on a timeout into
    failures/ (and by the watchdog when it ends the run). Not on gloo: the comm layer records those."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    failures.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(failures / "nccl_trace_rank"))


def _make_groups(parallel_cfg, layout: ParallelLayout, rank: int, world_size: int, device, log) -> tuple:
    """(the FSDP mesh, the gloo control group, the sequence groups, the sampling groups), each named in the
    comm log."""
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=parallel_cfg.timeout_s)
    control_timeout = datetime.timedelta(seconds=parallel_cfg.control_timeout_s)
    fsdp_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    # Groups made from a device mesh do not inherit the init timeout: set it explicitly.
    _set_pg_timeout(timeout, fsdp_mesh.get_group())
    control = dist.new_group(backend="gloo", timeout=control_timeout, group_desc="control")
    sequence = sequence_groups(layout, rank, timeout)
    sampling = sampling_groups(layout, rank, timeout, sequence, control_timeout, log)
    for group, name in (
        (fsdp_mesh.get_group(), "fsdp"),
        (control, "control"),
        (sequence.ulysses_group, "ulysses"),
        (sequence.ring_group, "ring"),
        (sequence.sp_group, "sequence"),
    ):
        if group is not None:  # None: a one-rank group, nothing to create
            log.adopt(group, name)
    return fsdp_mesh, control, sequence, sampling


def _start_watchdog(rank, world_size, run_dir, limits, backend, task, log, stop, session) -> Watchdog:
    """The heartbeats, on the store torchrun runs (none for one process): from here on a rank that dies is
    named by the others."""
    store = connect_store(world_size, max(5.0, limits.silence_s / 2))
    monitor = Watchdog(rank, world_size, store, run_dir or ".", limits, backend, task=task, comm=log).start()
    stop.watchdog = monitor  # a stop signal in the loop notes the step it arrived in
    if session is not None:
        session.watchdog = monitor
    return monitor


def _init_process_group(backend, init_method, rank: int, world_size: int, device, timeout_s: float) -> None:
    """The default process group, and a preflight all-reduce with the short preflight timeout: a transport
    that cannot connect shows up here, in seconds."""
    try:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        probe = torch.ones(1, device=device)
        # Poll instead of blocking: on NCCL a hung transport would block .item() until the watchdog
        # kills the process from C++, and this message would never be printed.
        work = dist.all_reduce(probe, async_op=True)
        deadline = time.monotonic() + 0.9 * timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from every rank")
            time.sleep(0.01)
        if int(probe.item()) != world_size:
            raise RuntimeError(f"preflight all-reduce returned {probe.item()}, expected {world_size}")
    except Exception as e:
        raise RuntimeError(
            f"rank {rank}: the preflight all-reduce across {world_size} processes failed within "
            f"{timeout_s:.0f}s ({e}). {NCCL_HINT}"
        ) from e


def _check_same_layout(layout: ParallelLayout, rank: int, world_size: int, device) -> None:
    """Every rank must build the same groups from the same layout, or group creation waits forever. A rank
    can see another one (parallel.auto reading another GPU's links, other command-line overrides): one
    small all-gather before any group exists turns that into an error naming the ranks."""
    if world_size == 1:
        return
    mine = torch.tensor([getattr(layout, name) for name in DEGREES], dtype=torch.int64, device=device)
    everyone = torch.empty((world_size, len(DEGREES)), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(everyone, mine, None)
    layouts = [tuple(row) for row in everyone.cpu().tolist()]
    if len(set(layouts)) > 1:
        differ = ", ".join(
            f"rank {r}: ({','.join(map(str, lay))})" for r, lay in enumerate(layouts) if lay != layouts[0]
        )
        raise LayoutError(
            f"the ranks chose different layouts ({', '.join(DEGREES)}): rank 0: "
            f"({','.join(map(str, layouts[0]))}), {differ}; every rank must get the same command, "
            f"recipe and environment (with parallel.auto, the same kind of links)"
        )


def _archive_failures(folder: Path) -> None:
    """Records of an earlier failure of this run move to failures.<time>/, so that diagnose.py reads
    only this attempt's (NCCL's flight-recorder files, written on a timeout, stay)."""
    old = [p for p in folder.glob("*") if p.suffix in (".json", ".txt")] if folder.is_dir() else []
    if old:
        archive = folder.with_name(f"failures.{time.strftime('%Y%m%d-%H%M%S')}")
        archive.mkdir(parents=True, exist_ok=True)
        for path in old:
            path.replace(archive / path.name)


def _my_group(layout: ParallelLayout, rank: int, timeout, *axes, backend=None):
    """(this rank's process group along `axes`, its ranks); every process creates every such group, in
    the same order, from the layout's one rank generator. A one-rank group is None (nothing to create)."""
    ranks = layout.group_of(rank, *axes)
    if len(ranks) == 1:
        return None, ranks
    group, _ = dist.new_subgroups_by_enumeration(
        layout.groups(*axes), timeout=timeout, backend=backend, group_desc="+".join(axes)
    )
    return group, ranks


def sequence_groups(layout: ParallelLayout, rank: int, timeout) -> SequenceGroups:
    ulysses_group, ulysses_ranks = _my_group(layout, rank, timeout, "ulysses")
    ring_group, ring_ranks = _my_group(layout, rank, timeout, "ring")
    sp_group, sp_ranks = _my_group(layout, rank, timeout, "ulysses", "ring")
    return SequenceGroups(
        ulysses_group,
        len(ulysses_ranks),
        ulysses_ranks.index(rank),
        ring_group,
        ring_ranks,
        ring_ranks.index(rank),
        sp_group,
        len(sp_ranks),
        sp_ranks.index(rank),
    )


def sampling_groups(
    layout: ParallelLayout, rank: int, timeout, sequence: SequenceGroups, control_timeout=None, log=None
) -> SamplingGroups:
    """The cfg and PipeFusion groups (parallel/compute/pipefusion.py). PipeFusion's two directions get two
    process groups over the same ranks: two NCCL communicators, so a receive posted early in one direction
    never queues ahead of a send in the other. With `control_timeout`, also a gloo group per replica with that
    timeout, to fence the replica's writer (infer.py)."""
    cfg_group, cfg_ranks = _my_group(layout, rank, timeout, "cfg")
    forward_group, pipeline_ranks = _my_group(layout, rank, timeout, "pipefusion")
    return_group, _ = _my_group(layout, rank, timeout, "pipefusion")
    if layout.cfg * layout.pipefusion > 1:
        replica_group, replica_ranks = _my_group(
            layout, rank, timeout, "cfg", "pipefusion", "ring", "ulysses"
        )
    else:
        replica_group, replica_ranks = sequence.sp_group, layout.group_of(rank, "ring", "ulysses")
    replica_control = None
    if control_timeout is not None:
        replica_control, _ = _my_group(
            layout, rank, control_timeout, "cfg", "pipefusion", "ring", "ulysses", backend="gloo"
        )
    for group, name in (
        (cfg_group, "cfg"),
        (forward_group, "pipefusion"),
        (return_group, "pipefusion-return"),
        (replica_group, "replica"),
        (replica_control, "replica-control"),
    ):
        if group is not None:
            (log or comm.log_of(group)).adopt(group, name)
    return SamplingGroups(
        cfg_group,
        len(cfg_ranks),
        cfg_ranks.index(rank),
        forward_group,
        return_group,
        pipeline_ranks,
        pipeline_ranks.index(rank),
        sequence,
        replica_group,
        len(replica_ranks),
        replica_control,
    )
