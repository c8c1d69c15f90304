"""Does a distributed checkpoint slow the training steps after it? (BENCHMARKS.md, "Checkpoints")

Times forward+backward and the optimizer step of the demo-sized DiT under FSDP2 (one process, gloo)
before a checkpoint, after tessera's save (`parallel.checkpoints.checkpoint._on_io_group`: DCP on a gloo group
destroyed after the save) and after a plain `dcp.save` on a group that stays alive, for comparison.
Besides wall time it counts each step's voluntary context switches of every thread but the main one
(OpenMP workers put to sleep), which shows the cause even where a shared machine makes wall times swing.

    python scripts/bench_checkpoint.py [--steps 15] [--json out.json]
    python scripts/bench_checkpoint.py --tiny      # a 2-block, 32-wide DiT, 2 steps each: seconds
"""

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from models.dit.transformer import DiT  # noqa: E402
from parallel.checkpoints.checkpoint import _on_io_group  # noqa: E402
from parallel.compute.fsdp import parallelize_dit  # noqa: E402

# (DiT dims, batch, clip (frames, height, width)): the demo's DiT of 2026-11-23 (DiT-demo) on 8 x 32 x 32
# pixels, or --tiny's
DEMO = (dict(depth=4, hidden_size=128, num_heads=4), 8, (8, 32, 32))
TINY = (dict(depth=2, hidden_size=32, num_heads=2), 2, (4, 16, 16))


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


def main(argv=None):
    p = benchlib.parser(__doc__)
    p.add_argument("--steps", type=int, default=15)
    args = benchlib.parse_args(p, argv, tiny=dict(steps=2))
    dims, batch, clip = TINY if args.tiny else DEMO
    port = benchlib.free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = parallelize_dit(DiT(3, 64, patch_size=(2, 4, 4), **dims), init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 3, *clip), torch.randn(batch, 40, 64)
    mask = torch.ones(batch, 40, dtype=torch.bool)
    rows = {}

    def bench(label):
        compute, update = [], []
        sleeps = worker_sleeps()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            model(x, torch.rand(batch), y, mask).square().mean().backward()
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            compute.append(t1 - t0)
            update.append(time.perf_counter() - t1)
        rows[label] = dict(
            forward_backward_ms=statistics.median(compute) * 1000,
            optimizer_ms=statistics.median(update) * 1000,
            worker_sleeps_per_step=(worker_sleeps() - sleeps) / args.steps,
            threads=len(os.listdir("/proc/self/task")),
        )
        print(
            f"[bench_checkpoint] {label}: {rows[label]['forward_backward_ms']:.1f} ms forward+backward",
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
    print()
    print(
        benchlib.table(
            ["state", "forward+backward", "optimizer", "worker sleeps/step", "threads"],
            [
                [label, f"{r['forward_backward_ms']:,.1f} ms", f"{r['optimizer_ms']:,.1f} ms"]
                + [f"{r['worker_sleeps_per_step']:,.0f}", r["threads"]]
                for label, r in rows.items()
            ],
        )
    )
    before, fixed, old = (
        rows["before"],
        rows["after dcp.save, short-lived group (fix)"],
        rows["after dcp.save, long-lived group (old)"],
    )
    compute, sleeps = "forward_backward_ms", "worker_sleeps_per_step"
    print(
        f"\nafter/before, forward+backward: fix {fixed[compute] / before[compute]:.2f}, "
        f"old {old[compute] / before[compute]:.2f}; worker sleeps: "
        f"fix {fixed[sleeps] / max(before[sleeps], 1):.2f}, old {old[sleeps] / max(before[sleeps], 1):.2f}"
    )
    print(
        f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        benchlib.write_json(args.json, {"steps": args.steps, "tiny": args.tiny, "rows": rows})


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
