"""infer.py under torchrun with one batch poisoned (tests/test_infer_io.py): the Euler steps of the
sampling numbered TESSERA_TEST_NAN_BATCH (counted from 1, as every rank of a replica counts them: each
runs every batch) turn the latents to NaN, as a model overflowing would (on rank TESSERA_TEST_NAN_RANK
only, if set). Every other batch samples as infer.py does."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import parallel.lifecycle.startup  # noqa: E402, F401  (first: before torch loads)

# isort: split

import infer  # noqa: E402
from models.flow import RectifiedFlow  # noqa: E402
from parallel.lifecycle.entrypoint import run_as_process  # noqa: E402

POISONED = int(os.environ["TESSERA_TEST_NAN_BATCH"])
ONLY_RANK = os.environ.get("TESSERA_TEST_NAN_RANK")  # set: only this rank's sampling turns NaN
walk, euler_step, calls = RectifiedFlow.walk, RectifiedFlow.euler_step, [0]


def counted_walk(self, *args, **kwargs):  # once a batch: every layout but PipeFusion walks the schedule here
    calls[0] += 1
    return walk(self, *args, **kwargs)


def poisoned_step(x, v, sigmas, i):
    out = euler_step(x, v, sigmas, i)
    mine = ONLY_RANK is None or ONLY_RANK == os.environ.get("RANK", "0")
    return out * float("nan") if calls[0] == POISONED and mine else out


RectifiedFlow.walk = counted_walk
RectifiedFlow.euler_step = staticmethod(poisoned_step)

if __name__ == "__main__":
    run_as_process(infer.main)
