"""The data pipeline across processes: the plan check, and 3 processes training for several epochs on
a deliberately skewed dataset (7 clips in one bucket, 1 in another, a corrupt file) without a hang."""

import json

import pytest

from configs.rundir import read_data_report, read_metrics
from data.manifest import write_manifest
from tests.conftest import TINY, ranks
from tests.test_decode import write_counter_video

pytestmark = pytest.mark.slow


def test_plan_check_names_the_ranks_that_differ():
    result = ranks(3, "tests/data_worker.py", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count(": same ok") == 3 and "detected same" not in out, out
    for label in ("plan", "steps", "data", "checkpoint", "base"):  # every rank reports each, none passes it
        assert out.count(f": detected {label}:") == 3 and f": {label} ok" not in out, out
    assert "ranks 0, 1: 2 steps per epoch" in out and "rank 2: 2 steps per epoch" in out  # the plan case
    assert "rank 1: 3 steps per epoch" in out, out
    data_lines = [line for line in out.splitlines() if ": detected data:" in line]
    assert all(
        "rank 0: 2 steps per epoch" in line and "ranks 1, 2: 2 steps per epoch" in line for line in data_lines
    )
    assert (
        "ranks 0, 1: 2 steps per epoch" in out
        and "resuming at step 1; rank 2:" in out
        and "no checkpoint)" in out
    )


def test_three_processes_train_several_epochs_on_a_skewed_dataset(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    entries = []
    for i in range(7):  # bucket 8x16x16
        write_counter_video(data / f"long{i}.mp4", frames=10, fps=8, height=16, width=16)
        entries.append({"path": f"long{i}.mp4", "caption": f"a red square moving left {i}"})
    write_counter_video(data / "short.mp4", frames=5, fps=8, height=16, width=16)  # bucket 4x16x16
    entries.append({"path": "short.mp4", "caption": "a blue circle moving up"})
    (data / "corrupt.mp4").write_bytes(b"not a video at all" * 50)
    entries.append(
        {"path": "corrupt.mp4", "caption": "broken", "width": 16, "height": 16, "num_frames": 10, "fps": 8}
    )  # sizes listed, so it is not probed: it fails when loaded
    write_manifest(data / "manifest.jsonl", entries)
    run = tmp_path / "run"
    # bucket 8x16x16: 8 samples -> 4 batches of 2; bucket 4x16x16: 1 batch of 1; 5 batches padded to 6 = 2
    # steps
    result = ranks(
        3,
        "train.py",
        "--config",
        str(TINY),
        f"run.output_dir={run}",
        f"data.manifest={data / 'manifest.jsonl'}",
        "data.frame_counts=[4,8]",
        "train.batch_size=2",
        "data.num_workers=1",
        "train.max_steps=8",
        "train.checkpoint_every=8",
        "sample.steps=1",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    log = result.stdout + result.stderr
    assert "2 steps per epoch (5 batches + 1 repeated to fill every rank)" in log
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert [m["epoch"] for m in metrics] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(set(m["buckets"]) <= {"8x16x16", "4x16x16"} for m in metrics)
    assert sum(m["buckets"].get("4x16x16", 0) for m in metrics) >= 4  # the lone clip trains every epoch
    # the corrupt clip comes up at least once per epoch; each rank names it at most once
    assert metrics[-1]["replaced_samples"] >= 4
    replaced_lines = [line for line in log.splitlines() if "replaced" in line and "corrupt.mp4" in line]
    assert 1 <= len(replaced_lines) <= 3 and len({line.split(":")[0] for line in replaced_lines}) == len(
        replaced_lines
    )
    # ... and lists it in the run's data report, each rank in its own file (no interleaved writers)
    reported = [r for r in read_data_report(run) if r["kind"] == "replaced"]
    assert sorted(r["rank"] for r in reported) == sorted(
        int(line.split(":")[0].split()[-1]) for line in replaced_lines
    )
    assert all(r["path"].endswith("corrupt.mp4") and 1 <= r["step"] <= 8 for r in reported)
    for r in reported:
        own = run / ("data_report.jsonl" if r["rank"] == 0 else f"data_report_rank{r['rank']}.jsonl")
        assert [json.loads(line)["rank"] for line in own.read_text().splitlines()] == [r["rank"]]
