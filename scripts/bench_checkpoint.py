"""Does a distributed checkpoint slow the training steps after it? (an open finding, see BENCHMARKS.md)

Times forward+backward and the optimizer step of the demo-sized DiT under FSDP2 (one process, gloo),
before and after `torch.distributed.checkpoint.save`, and after each suspect in between.

    python scripts/bench_checkpoint.py [--steps 15]
"""

import argparse
import os
import shutil
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
from parallel.fsdp import parallelize_dit  # noqa: E402
from parallel.runtime import _free_port  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = parallelize_dit(DiT(3, 64, depth=4, hidden_size=128, num_heads=4, patch_size=(2, 4, 4)),
                            init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y, mask = torch.randn(8, 3, 8, 32, 32), torch.randn(8, 40, 64), torch.ones(8, 40, dtype=torch.bool)

    def bench(label):
        compute = update = 0.0
        for _ in range(args.steps):
            t0 = time.perf_counter()
            model(x, torch.rand(8), y, mask).square().mean().backward()
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            compute, update = compute + t1 - t0, update + time.perf_counter() - t1
        print(f"{label:32s} forward+backward {compute / args.steps * 1000:7.1f} ms   optimizer {update / args.steps * 1000:6.1f} ms",
              flush=True)

    bench("warm-up")
    bench("before")
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    bench("after get_*_state_dict")
    folder = tempfile.mkdtemp()
    try:
        dcp.save(state, checkpoint_id=folder)
        bench("after dcp.save")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()
    print(f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")


if __name__ == "__main__":
    main()
