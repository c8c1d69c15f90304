"""Does a distributed checkpoint slow the training steps after it? (issue 12, BENCHMARKS.md)

Times forward+backward and the optimizer step of the demo-sized DiT under FSDP2 (one process, gloo)
before a checkpoint, after tessera's save (`parallel.checkpoint._on_io_group`: DCP on a gloo group
destroyed after the save), and after a plain `dcp.save` on a group that stays alive (what tessera did
before issue 12). Besides wall time it counts the voluntary context switches of every thread but the
main one per step: an OpenMP worker that spins between parallel regions rarely sleeps, one whose
spin-wait libgomp has throttled sleeps on a futex after nearly every region. That count is a
property of the process, not of how busy the machine is, so it shows the cause on a shared machine
where wall times swing.

    python scripts/bench_checkpoint.py [--steps 15]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from models.dit import DiT  # noqa: E402
from parallel.checkpoint import _on_io_group  # noqa: E402
from parallel.fsdp import parallelize_dit  # noqa: E402
from parallel.runtime import _free_port  # noqa: E402


def worker_sleeps() -> int:
    """Voluntary context switches, summed over every thread of this process except the main one."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches")
                )
        except (FileNotFoundError, StopIteration):  # a thread that ended meanwhile
            pass
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = parallelize_dit(
        DiT(3, 64, depth=4, hidden_size=128, num_heads=4, patch_size=(2, 4, 4)), init_device_mesh("cpu", (1,))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y, mask = torch.randn(8, 3, 8, 32, 32), torch.randn(8, 40, 64), torch.ones(8, 40, dtype=torch.bool)
    rows = {}

    def bench(label):
        compute, update = [], []
        sleeps = worker_sleeps()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            model(x, torch.rand(8), y, mask).square().mean().backward()
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            compute.append(t1 - t0)
            update.append(time.perf_counter() - t1)
        rows[label] = (
            statistics.median(compute) * 1000,
            statistics.median(update) * 1000,
            (worker_sleeps() - sleeps) / args.steps,
            len(os.listdir("/proc/self/task")),
        )
        print(
            f"{label:40s} forward+backward {rows[label][0]:7.1f} ms   optimizer {rows[label][1]:6.1f} ms   "
            f"worker sleeps/step {rows[label][2]:6.0f}   threads {rows[label][3]}",
            flush=True,
        )

    def state():
        return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}

    bench("warm-up")
    bench("before")
    folder = tempfile.mkdtemp()
    try:
        _on_io_group(
            dist.group.WORLD,
            lambda group: dcp.save(state(), checkpoint_id=f"{folder}/a", process_group=group),
        )
        bench("after dcp.save, short-lived group (fix)")
        kept = dist.new_group(backend="gloo")  # the control group before issue 12: alive for the whole run
        dcp.save(state(), checkpoint_id=f"{folder}/b", process_group=kept)
        bench("after dcp.save, long-lived group (old)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()
    before, fixed, old = (
        rows["before"],
        rows["after dcp.save, short-lived group (fix)"],
        rows["after dcp.save, long-lived group (old)"],
    )
    print(
        f"after/before, forward+backward: fix {fixed[0] / before[0]:.2f}, old {old[0] / before[0]:.2f}; "
        f"worker sleeps: fix {fixed[2] / max(before[2], 1):.2f}, old {old[2] / max(before[2], 1):.2f}"
    )
    print(
        f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
