"""Run under torchrun (2 processes) by tests/test_checkpoint.py: the ranks split the checking of a
checkpoint's files and all reach the same verdict, even on a file only one of them read."""

import datetime
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.checkpoints import (
    checkpoint_files,  # noqa: E402
    checkpoint_reading,
)


def main(paths):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    read = []
    size_and_crc = checkpoint_reading._size_and_crc  # what verify_checkpoint calls

    def recorded(path, sync=False):
        read.append(Path(path).name)
        return size_and_crc(path, sync)

    checkpoint_reading._size_and_crc = recorded
    for path in paths:
        read.clear()
        try:
            checkpoint_reading.verify_checkpoint(path, dist.group.WORLD)
            verdict = "ok"
        except checkpoint_files.CheckpointError as e:
            verdict = f"refused: {e}"
        line = f"rank {rank}: {Path(path).parent.parent.name}: read {sorted(read)}: {verdict}\n"
        os.write(
            1, line.encode()
        )  # one write: print() writes the text and the newline apart, and ranks interleave
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main(sys.argv[1:])
    leave_finished()  # gloo threads must not outlive the interpreter
