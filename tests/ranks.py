"""A launcher for the suite's multi-process tests: the ranks of train.py, infer.py or a script, forked from
one server process per pytest worker that has already imported torch, transformers and diffusers, instead
of `torchrun` starting a fresh interpreter per rank (about 8 s of imports each, on 2 cores most of a tiny
launch). As under torchrun, the launcher hosts the store (TORCHELASTIC_USE_AGENT_STORE: the ranks take
parallel/lifecycle/runtime.py's torchrun path) and gives RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT;
the first rank to fail gets the others a SIGTERM; a launch that outlives `timeout` is killed and raises
subprocess.TimeoutExpired. The tests of torchrun's own behaviour (its agent, its signals, two nodes,
requeues) keep `torchrun`.
"""

import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a rank of train.py or infer.py imports before its first step: imported once, in the server.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "transformers.models.t5.modeling_t5",
    "transformers.models.clip.modeling_clip",
    "diffusers",
    "diffusers.models.autoencoders.autoencoder_kl_wan",
    "diffusers.schedulers.scheduling_flow_match_euler_discrete",
    "train",
    "infer",
]
PEER_GRACE_S = 30.0  # after a rank fails, how long the others get to end on their SIGTERM (torchrun: 30 s)

_context = None


def _server():
    """The forkserver context, its preload set (the server itself starts at the first launch)."""
    global _context
    if _context is None:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _rank(script: str, args: list, env: dict, out: str, err: str) -> None:
    """One rank, in a child of the server: its output to files, then the script as `__main__`."""
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()  # the launching test's environment now, as a subprocess gets it (not the server's)
    os.environ.update(env)
    os.chdir(ROOT)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")  # train.py's own __main__ exits with the run's code
    except SystemExit:
        raise
    except BaseException:  # as an interpreter ends on one: sys.excepthook (torch's adds "[rankN]:"), code 1
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        os._exit(1)


def launch(
    nproc: int,
    script: str,
    *args: str,
    timeout: float = 240,
    env: dict | None = None,
    agent_store: bool = True,
):
    """`torchrun --standalone --nproc_per_node nproc script args`, forked: a CompletedProcess whose stdout
    and stderr are the ranks' in rank order, whose code is the first failing rank's (else 0), and whose
    `codes` are each rank's. agent_store=False: as another launcher (srun, mpirun), rank 0 hosts the store
    (parallel/lifecycle/runtime.py's other path)."""
    import torch.distributed as dist

    context = _server()
    # torchrun's agent store: bound here on a free port (no race for it), alive until every rank has ended.
    # Without it, rank 0 binds a port found free here (a short race).
    store = (
        dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False) if agent_store else None
    )
    base = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "GROUP_RANK": "0",
    }
    base.update(MASTER_PORT=str(store.port if store else _free_port()), WORLD_SIZE=str(nproc))
    base.update(LOCAL_WORLD_SIZE=str(nproc))
    if store:
        base.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    with tempfile.TemporaryDirectory(prefix="tessera-ranks-") as folder:
        files = [(f"{folder}/out{r}", f"{folder}/err{r}") for r in range(nproc)]
        procs = []
        try:
            for rank in range(nproc):
                rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                proc = context.Process(
                    target=_rank, args=(str(ROOT / script), list(args), rank_env, *files[rank])
                )
                proc.start()
                procs.append(proc)
            code, timed_out = _wait(procs, timeout)
        finally:  # an interrupted wait (a test's timeout, Ctrl-C) leaves no rank running
            for p in procs:
                p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        stdout, stderr = ("".join(_read(f[i]) for f in files) for i in (0, 1))
    del store
    cmd = ["ranks", str(nproc), script, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    done = subprocess.CompletedProcess(cmd, code, stdout, stderr)
    done.codes = codes  # each rank's exit code (torchrun prints them in its summary)
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    """A rank's output file ("" if the rank died before it made one)."""
    return Path(path).read_text(errors="replace") if Path(path).exists() else ""


def _wait(procs: list, timeout: float) -> tuple[int, bool]:
    """Every rank's end; SIGTERM to the rest once one fails (as torchrun's agent does), SIGKILL to all at
    `timeout` or PEER_GRACE_S after that. Returns (the first failing rank's code or 0, timed out)."""
    deadline, first, grace = time.monotonic() + timeout, 0, None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed and not first:
            first, grace = failed[0], now + PEER_GRACE_S
            for p in procs:
                if p.exitcode is None:
                    p.terminate()  # SIGTERM; a rank that has just ended is no error
        if now > deadline or (grace is not None and now > grace):
            return first or -signal.SIGKILL, now > deadline  # launch() kills the rest
        time.sleep(0.05)
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    return first or (failed[0] if failed else 0), False
