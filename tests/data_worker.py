"""Run under torchrun (3 processes) by tests/test_data_parallel.py: the start-up check that every rank
has the same data passes when they agree and, when one rank's data differs (another bucket for one
file, more files, other captions, a checkpoint it does not see), fails on every rank with a message that names
the ranks (instead
of a hang in a later collective, or ranks silently training on different samples)."""

import datetime
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_config  # noqa: E402
from data.dataset import MediaDataset  # noqa: E402
from data.loader import build_buckets, build_sampler, check_same_plan  # noqa: E402
from tests.conftest import TINY  # noqa: E402


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(TINY, ["data.frame_counts=[4,8]", "train.batch_size=2", "train.seed=3"])
    table = build_buckets(cfg)

    def dataset(long=7, short=1, caption="clip", first_frames=10):
        """Manifest lines with their sizes: bucketed without opening a file. Long clips fill 8 frames."""
        lines = [
            {
                "path": f"long{i}.mp4",
                "caption": f"{caption} {i}",
                "width": 16,
                "height": 16,
                "fps": 8,
                "num_frames": first_frames if i == 0 else 10,
            }
            for i in range(long)
        ]
        lines += [
            {
                "path": f"short{i}.mp4",
                "caption": f"short {i}",
                "width": 16,
                "height": 16,
                "fps": 8,
                "num_frames": 5,
            }
            for i in range(short)
        ]
        return MediaDataset(lines, table)

    def check(data, step, label, base=""):
        try:
            check_same_plan(build_sampler(cfg, data, table, rank, world), data, step, base=base)
            print(f"rank {rank}: {label} ok", flush=True)
        except ValueError as e:
            print(f"rank {rank}: detected {label}: {e}", flush=True)

    check(dataset(), 5, "same")
    check(
        dataset(first_frames=5 if rank == 2 else 10), 5, "plan"
    )  # probed shorter here: same steps, other plan
    check(dataset(long=11 if rank == 1 else 7), 0, "steps")  # more batches on rank 1
    check(dataset(caption="other" if rank == 0 else "clip"), 0, "data")  # same plan, other captions
    check(
        dataset(), None if rank == 2 else 1, "checkpoint"
    )  # rank 2 does not see the checkpoint (same epoch)
    # a LoRA base run that wrote a new `latest` between rank 1's read and the others'
    check(dataset(), 0, "base", base="runs/base/checkpoints/step_20" if rank == 1 else "runs/base/step_10")
    dist.barrier()  # every rank is still in step after the errors: nobody hung
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
