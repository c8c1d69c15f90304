"""scripts/slurm.sh under a stand-in SLURM (srun runs its command here, scontrol records a requeue):
SIGUSR1 before the time limit reaches every rank through torchrun, the run saves and stops, and the
job requeues itself."""

import os
import signal
import socket
import subprocess
import time

import pytest

from configs.rundir import read_metrics
from tests.conftest import ROOT, TINY

pytestmark = pytest.mark.slow

FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done   # srun's own options
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> "$SCONTROL_LOG"; fi
"""


def test_sigusr1_saves_stops_and_requeues(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir, log = tmp_path / "run", tmp_path / "scontrol.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "TESSERA_RDZV_PORT": str(port),
        "SCONTROL_LOG": str(log),
        "OMP_NUM_THREADS": "1",
    }
    script = subprocess.Popen(
        [
            "bash",
            "scripts/slurm.sh",
            str(TINY),
            f"run.output_dir={run_dir}",
            "train.max_steps=500",
            "train.checkpoint_every=500",
            "data.synthetic_samples=4",
            "train.batch_size=2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 150
    while not ((run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= 3):
        assert time.monotonic() < deadline and script.poll() is None, script.stdout.read()[-3000:]
        time.sleep(0.05)
    script.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does 120 s before the time limit
    try:
        output, _ = script.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        script.kill()
        raise
    assert script.returncode == 0, output[-3000:]
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 3 <= step < 500 and f"stopped at step {step} by SIGUSR1" in output, output[-3000:]
    assert "requeue 42" in log.read_text()
