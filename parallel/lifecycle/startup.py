"""Imported first by the entry points (train.py, infer.py, eval_demo.py, precompute_latents.py), before
torch loads, for what must be in place before the seconds of imports (and torchao's warnings, below):

- PyTorch's C++ warnings each carry a dozen stack frames, and when a node is lost every failed store
  call logs one: they would bury the `error:` line that names the cause. TORCH_CPP_LOG_LEVEL is read
  once, when torch loads; a value set by the user is kept (TORCH_CPP_LOG_LEVEL=WARNING shows them
  again). C++ errors are still printed.
- torchrun sends SIGTERM to every rank as soon as one rank fails, often while the others are still
  importing: a rank about to reach the same refusal would die silently (exit -15). A SIGTERM that
  arrives now is noted, and run_entrypoint's handler (parallel/lifecycle/watchdog.py, StopRequest) takes it
  over.
"""

import logging
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# torchao (train.fp8; transformers imports it whenever it is installed) logs a warning for each of its
# C++ kernels a wheel cannot load, and torch one for each enum torchao registers with pytree: four lines
# before the first of tessera's, on every run; none is about what tessera uses (torch's float8 matmul).
# diffusers 0.42 warns "Unable to import `torchao` Tensor objects" with torchao 0.18 (for its loader of
# torchao-quantized pipelines, which tessera does not use).
for _name in ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
    logging.getLogger(_name).setLevel(logging.ERROR)

noted: tuple[int, float] | None = None  # (signal, time.monotonic()) of a SIGTERM during start-up


def note(signum, frame):
    global noted
    noted = noted or (signum, time.monotonic())


def take_noted() -> tuple[int, float] | None:
    """The SIGTERM noted before the real handler was installed, if any (and forget it)."""
    global noted
    taken, noted = noted, None
    return taken


# Only in a process started as one of them (not, say, in pytest, which imports train.py for its tests).
ENTRY_POINTS = ("train.py", "infer.py", "eval_demo.py", "precompute_latents.py")
if Path(getattr(sys.modules.get("__main__"), "__file__", None) or "").name in ENTRY_POINTS:
    signal.signal(signal.SIGTERM, note)
