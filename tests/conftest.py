import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "tiny.yaml"
sys.path.insert(0, str(ROOT))  # train.py and infer.py live at the root
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
if os.environ.get("PYTEST_XDIST_WORKER"):  # scripts/test.sh runs two workers on a 2-core machine: one
    import torch  # thread each, or their intra-op threads contend (tiny models gain nothing from two)

    torch.set_num_threads(1)


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240, env: dict | None = None):
    """Run `torchrun --nproc_per_node nproc script args` from the repo root; a hang fails at `timeout`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


def ranks(nproc: int, script: str, *args: str, timeout: float = 240, env: dict | None = None, **launch_args):
    """`torchrun(...)` for the tests that check what the ranks compute, not torchrun's own behaviour: the
    ranks are forked from a process that has imported torch, transformers and diffusers (tests/ranks.py),
    seconds instead of a fresh interpreter's imports per rank."""
    from tests.ranks import launch

    return launch(nproc, script, *args, timeout=timeout, env=env, **launch_args)


def run_main(module, argv: list[str]) -> int:
    """Run an entry point in this process (saves seconds of imports per run) and return its exit code."""
    from parallel.lifecycle.entrypoint import run_entrypoint

    return run_entrypoint(module.main, argv)


@pytest.fixture
def tiny_args(tmp_path):
    return ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}"]
