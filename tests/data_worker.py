"""Run under torchrun (3 processes) by tests/test_data_parallel.py: the start-up check that every rank
has the same data plan passes when they agree and, when one rank's data differs, fails on every rank
with a message that names the ranks (instead of a hang in a later collective)."""

import datetime
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.loader import check_same_plan  # noqa: E402
from data.sampler import BucketSampler  # noqa: E402


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    buckets = np.repeat([0, 1], [7, 1])
    check_same_plan(BucketSampler(buckets, [2, 2], rank, world, seed=3), step=5)  # agree: no error
    print(f"rank {rank}: same plan ok", flush=True)

    skewed = buckets.copy()
    if rank == 2:
        skewed[0] = 1  # one file probed differently on this rank: same steps, another plan
    try:
        check_same_plan(BucketSampler(skewed, [2, 2], rank, world, seed=3), step=5)
        print(f"rank {rank}: mismatch NOT detected", flush=True)
    except RuntimeError as e:
        print(f"rank {rank}: detected: {e}", flush=True)

    fewer = np.repeat([0, 1], [7, 1]) if rank != 1 else np.repeat([0, 1], [11, 1])  # more batches on rank 1
    try:
        check_same_plan(BucketSampler(fewer, [2, 2], rank, world, seed=3), step=0)
        print(f"rank {rank}: step mismatch NOT detected", flush=True)
    except RuntimeError as e:
        print(f"rank {rank}: detected steps: {e}", flush=True)
    dist.barrier()  # every rank is still in step after the errors: nobody hung
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
