"""The run's data_report.jsonl: every file left out at start-up and every file replaced during training,
with its reason; the start-up summary names missing and unreadable files first."""

import json

import pytest

import train
from configs.rundir import RunDirectory, read_data_report
from data.manifest import write_manifest
from tests.conftest import TINY, run_main
from tests.test_decode import messy_folder, write_counter_video  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


def test_every_left_out_and_replaced_file_is_listed_with_its_reason(messy_folder, tmp_path, capfd):  # noqa: F811
    folder = messy_folder
    # Ten files left out by choice come first in the manifest; the broken ones after them.
    lines = [{"path": f"notes{i}.txt", "caption": "not media"} for i in range(10)]
    lines += [{"path": f"good{i}.mp4", "caption": f"clip {i}"} for i in range(4)]  # probed: no sizes
    lines += [
        {"path": "short.mp4", "caption": "3 frames"},  # too short for the 4-frame bucket
        {"path": "corrupt.mp4", "caption": "broken"},  # probed: unreadable
        {"path": "gone.mp4", "caption": "deleted"},  # probed: missing
        {
            "path": "gone_later.mp4",
            "caption": "listed with its sizes, deleted since",
            "width": 48,
            "height": 32,
            "num_frames": 20,
            "fps": 8,
        },
    ]  # not probed: replaced when loaded
    write_manifest(folder / "manifest.jsonl", lines)
    run_dir = tmp_path / "run"
    args = [
        "--config",
        str(TINY),
        f"run.output_dir={run_dir}",
        f"data.manifest={folder / 'manifest.jsonl'}",
        "train.batch_size=5",
        "train.max_steps=2",
        "train.checkpoint_every=2",
        "sample.steps=1",
    ]  # 5 samples: each
    # step reads all
    assert run_main(train, args) == 0
    out = capfd.readouterr().out

    # The summary names the missing and the unreadable file first, then as many others as fit.
    named = [
        line.split(": ")[0].rsplit("/", 1)[1] for line in out.splitlines() if line.startswith("  left out ")
    ]
    assert named[:2] == ["gone.mp4", "corrupt.mp4"] and len(named) == 10, out
    assert (
        "left out 13: 1 missing, 1 unreadable, 1 too short (fewer than 4 frames), 10 unsupported file type"
        in out
    )
    assert "... and 3 more" in out and f"is listed in {run_dir / 'data_report.jsonl'}" in out
    # The clips probed at start-up say they carry no sound; the line listed with its sizes does not say.
    assert "5 samples in 1 of 1 buckets (0 of 4 carry sound; 1 not indexed for sound); left out 13" in out

    report = read_data_report(run_dir)
    left_out = {r["path"].rsplit("/", 1)[1]: r for r in report if r["kind"] == "left_out"}
    assert set(left_out) == {f"notes{i}.txt" for i in range(10)} | {"short.mp4", "corrupt.mp4", "gone.mp4"}
    assert [r["path"].rsplit("/", 1)[1] for r in report[:2]] == ["gone.mp4", "corrupt.mp4"]
    assert left_out["gone.mp4"]["category"] == "missing" and "No such file" in left_out["gone.mp4"]["reason"]
    assert left_out["corrupt.mp4"]["category"] == "unreadable" and left_out["corrupt.mp4"]["reason"]
    assert left_out["notes0.txt"]["reason"] == "unsupported file type '.txt'"
    assert left_out["short.mp4"]["reason"].startswith("too short")
    replaced = [r for r in report if r["kind"] == "replaced"]
    assert len(replaced) == 1, replaced  # once, though every step replaced it
    assert (
        replaced[0]["path"].endswith("gone_later.mp4")
        and replaced[0]["step"] == 1
        and replaced[0]["rank"] == 0
    )
    assert "No such file" in replaced[0]["reason"]
    assert sum(1 for _ in open(run_dir / "data_report.jsonl")) == 14  # one JSON object per line, one file


def test_a_resumed_run_rewrites_the_start_up_part_and_keeps_what_was_replaced_before_its_step(tmp_path):
    run = RunDirectory(tmp_path, is_main=True)
    run.start_data_report(
        [("a.mp4", "unreadable", "InvalidDataError: ..."), ("b.txt", "no caption", "no caption")], 0
    )
    run.report_replaced(0, "c.mp4", "FileNotFoundError: c.mp4", step=2)
    RunDirectory(tmp_path, is_main=False).report_replaced(1, "d.mp4", "ValueError: too short", step=5)
    (tmp_path / "data_report_rank1.jsonl").open("a").write('{"kind": "replaced", "pa')  # a line cut by a kill
    assert [(r["kind"], r["path"]) for r in read_data_report(tmp_path)] == [
        ("left_out", "a.mp4"),
        ("left_out", "b.txt"),
        ("replaced", "c.mp4"),
        ("replaced", "d.mp4"),
    ]
    RunDirectory(tmp_path, is_main=False).start_data_report(
        [("z.mp4", "missing", "gone")], 3
    )  # not the main rank
    run.start_data_report([("a.mp4", "unreadable", "InvalidDataError: ...")], 3)  # resumed at step 3
    assert [(r["kind"], r["path"]) for r in read_data_report(tmp_path)] == [
        ("left_out", "a.mp4"),
        ("replaced", "c.mp4"),
    ]
    assert not list(tmp_path.glob("data_report_rank*")) and not list(tmp_path.glob("*.tmp"))
    assert all(json.loads(line) for line in open(tmp_path / "data_report.jsonl"))
