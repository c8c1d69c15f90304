"""What a run shows besides metrics.jsonl, in this process from fake metrics: report.png (curves and the
newest preview, redrawn at each checkpoint), TensorBoard's scalars and preview GIFs read back from the
event files, a logger that fails warning instead of stopping the run, and logging.tensorboard refused by
name when TensorBoard is missing. The wandb files of a real run: tests/test_e2e.py."""

import io
import math
import re
import sys
import warnings

import numpy as np
import pytest
from PIL import Image

from configs import load_config
from configs.report import ema, short
from configs.rundir import RunDirectory, check_loggers, read_metrics
from data.media import write_video
from tests.conftest import TINY, run_main


def metrics(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.0 / step + 0.05 * math.sin(step),
        "lr": 1e-3 * min(1.0, step / 4),
        "grad_norm": 2.0 / step**0.5,
        "step_time": 0.1,
        "samples_per_s": 40.0 + step % 3,
        "tokens_per_s": 10240.0 + step % 7,
        "epoch": 0,
        "buckets": {"4x16x16": 1},
        "replaced_samples": 0,
    }


def moving_square(frames: int = 6) -> np.ndarray:
    video = np.zeros((frames, 16, 16, 3), np.float32)
    for f in range(frames):
        video[f, 6:10, 2 * f : 2 * f + 4, 0] = 1.0  # red, moving right
    return video


@pytest.fixture
def run(tmp_path):
    run = RunDirectory(tmp_path / "run", is_main=True)
    cfg = load_config(TINY, [f"run.output_dir={run.path}", "logging.tensorboard=true"])
    run.write_config(cfg)  # the report's captions come from its sample.prompts
    run.start_tensorboard(cfg, start_step=0)
    yield run
    run.finish()


def test_report_png_is_drawn_at_each_checkpoint_and_changes(run):
    for step in range(1, 4):
        run.log_metrics(metrics(step))
    run.checkpointed()
    first = (run.path / "report.png").read_bytes()
    width, height = Image.open(io.BytesIO(first)).size
    assert width >= 800 and height >= 400 and len(first) > 10_000
    for step in range(4, 7):
        run.log_metrics(metrics(step))
    video = moving_square()
    write_video(run.preview_path(6, 0), video, fps=8)
    run.log_previews(6, {0: ("a red square moving left", video)}, fps=8)
    run.checkpointed()
    second = (run.path / "report.png").read_bytes()
    assert second != first
    report = np.asarray(Image.open(io.BytesIO(second)).convert("RGB"))
    assert report.shape[0] > height  # a row of preview frames below the curves
    strip = report[height:]
    reds = (strip[..., 0] > 200) & (strip[..., 1] < 80)
    assert reds.sum() > 500  # the red square, enlarged from 16 x 16
    assert not list(run.path.glob("*.tmp"))


def test_tensorboard_holds_the_scalars_and_the_previews(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for step in range(1, 4):
        run.log_metrics(metrics(step))
    video = moving_square()
    write_video(run.preview_path(3, 0), video, fps=8)
    run.log_previews(3, {0: ("a red square moving left", video)}, fps=8)
    run.finish()
    events = EventAccumulator(str(run.path / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert {"loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s"} <= set(events.Tags()["scalars"])
    assert "buckets" not in events.Tags()["scalars"] and "step" not in events.Tags()["scalars"]
    assert logged(events, "loss") == {s: pytest.approx(metrics(s)["loss"]) for s in (1, 2, 3)}
    (preview,) = events.Images("preview/0")
    gif = Image.open(io.BytesIO(preview.encoded_image_string))
    assert preview.step == 3 and gif.format == "GIF" and gif.n_frames == 6
    assert gif.size == (preview.width, preview.height) == (320, 320)  # 16 x 16, enlarged to be seen


def test_a_resume_hides_the_tensorboard_steps_it_logs_again(run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for step in range(1, 6):  # a run checkpointed at 3 and stopped at 5
        run.log_metrics(metrics(step))
    run.finish()
    cfg = load_config(TINY, [f"run.output_dir={run.path}", "logging.tensorboard=true"])
    run.start_tensorboard(cfg, start_step=3)
    for step in range(4, 7):
        run.log_metrics(metrics(step) | {"loss": 10.0 * step})
    run.finish()
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    again = {4: 40.0, 5: 50.0, 6: 60.0}
    assert logged(events, "loss") == {s: pytest.approx(metrics(s)["loss"]) for s in (1, 2, 3)} | again


def test_a_fresh_start_hides_every_earlier_tensorboard_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for step in range(1, 3):  # killed before its first checkpoint, then started again from step 0
        run.log_metrics(metrics(step))
    run.finish()
    run.start_tensorboard(load_config(TINY, [f"run.output_dir={run.path}", "logging.tensorboard=true"]), 0)
    run.log_metrics(metrics(1) | {"loss": 7.0})
    run.finish()
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    assert logged(events, "loss") == {1: 7.0}


def test_the_report_reads_a_bounded_sample_and_no_preview_after_the_last_logged_step(run):
    from configs.report import read_lines, write_report

    for step in range(1, 51):
        run.log_metrics(metrics(step))
    kept = read_lines(run.path / "metrics.jsonl", most=10)
    assert len(kept) == 10 and kept[0]["step"] == 1 and kept[-1]["step"] == 50
    write_video(run.preview_path(60, 0), moving_square(), fps=8)  # a set-aside process's, after step 50
    report = np.asarray(Image.open(write_report(run.path)).convert("RGB"))
    reds = (report[..., 0] > 200) & (report[..., 1] < 80)
    assert reds.sum() < 50, "a preview from after the last logged step was drawn"


def logged(events, tag: str) -> dict:
    """step: value of a scalar (each step once: a step logged twice would be lost in a dict)."""
    steps = [e.step for e in events.Scalars(tag)]
    assert len(steps) == len(set(steps)), steps
    return {e.step: e.value for e in events.Scalars(tag)}


def test_a_failing_logger_or_report_warns_and_the_run_goes_on(run):
    class Broken:
        def add_scalar(self, *args):
            raise OSError("No space left on device")

    run._tensorboard = Broken()
    with pytest.warns(UserWarning, match="tensorboard failed .No space left on device.; it logs nothing"):
        run.log_metrics(metrics(1))
    assert run._tensorboard is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.log_metrics(metrics(2))  # no warning a step: it is gone
    assert [m["step"] for m in read_metrics(run.path)] == [1, 2]
    (run.path / "samples" / "step_2_0.mp4").write_bytes(b"not a video")  # costs its row, not the report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.checkpointed()
    (run.path / "report.png").unlink()
    (run.path / "report.png").mkdir()  # cannot be replaced
    with pytest.warns(UserWarning, match="report.png could not be drawn"):
        run.checkpointed()


def test_logging_tensorboard_is_refused_by_name_when_tensorboard_is_missing(monkeypatch, tmp_path, capsys):
    import train

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # find_spec: not installed
    args = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "logging.tensorboard=true"]
    assert run_main(train, args) == 2
    install = re.escape('pip install -e ".[tensorboard]"')
    assert re.search(f"error: logging.tensorboard=true needs TensorBoard.*{install}", capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # refused before the run directory is taken
    check_loggers(load_config(TINY, []))  # off by default: nothing to refuse
    load_config(TINY, ["logging.tensorboard=true"])  # infer.py reads such a recipe: it logs nothing


def test_the_smoothed_loss_and_the_labels():
    assert ema([1.0, 1.0, 1.0], span=5) == [1.0, 1.0, 1.0]  # debiased: not pulled towards 0 at the start
    smooth = ema([1.0, math.nan, 3.0], span=3)
    assert smooth[0] == 1.0 and smooth[1] == 1.0 and 1.0 < smooth[2] < 3.0
    assert [short(v) for v in (0.1234567, 10240.0, 2.5e6, 5e-05)] == ["0.1235", "10.24k", "2.5M", "5e-05"]
