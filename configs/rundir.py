"""The run directory (`run.output_dir`): what a run leaves behind.

config.yaml        the resolved recipe (an earlier, different one is kept as config.<time>.yaml)
metrics.jsonl      one JSON object per logged step: step, loss, lr, step_time, samples_per_s, ...; a resume
                   keeps the lines up to its checkpoint (the whole earlier file as metrics.<time>.jsonl)
checkpoints/       step_<N>/ (torch.distributed.checkpoint) and `latest`
samples/           preview videos (step_<N>_<i>.mp4: prompt i at step N), also in wandb and TensorBoard
report.png         the curves and the newest preview's frames, redrawn at each checkpoint and preview
failures/          per-rank records of recent collectives, written when a run fails
wandb/             offline wandb logs (`wandb sync` later); tensorboard/: TensorBoard's (logging.tensorboard)
data_report.jsonl  files left out at start-up or replaced, and why (rank R > 0: data_report_rank<R>.jsonl)
run.lock           while a run trains: its host, pid and heartbeat (given back: run.lock.<token>.released)
"""

import contextlib
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np

from configs import save_config, to_yaml


class RunDirectory:
    """The run directory of a training run. `guard` (train.py: Runtime.ensure_directory) is called before
    every write and raises once another run has taken the directory over (configs/runlock.py)."""

    def __init__(self, path, is_main: bool, guard=None):
        self.path = Path(path)
        self.is_main = is_main
        self.guard = guard or (lambda: None)
        self.samples = self.path / "samples"
        self.failures = self.path / "failures"
        self._wandb = None
        self._tensorboard = None  # a SummaryWriter
        if is_main:
            self.samples.mkdir(parents=True, exist_ok=True)

    def write_config(self, cfg) -> None:
        if not self.is_main:
            return
        self.guard()
        target = self.path / "config.yaml"
        if target.is_file() and target.read_text() != to_yaml(cfg):
            target.rename(self.path / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
        save_config(cfg, target)

    def start_wandb(self, cfg) -> None:
        if not (self.is_main and cfg.logging.wandb) or cfg.logging.wandb_mode == "disabled":
            return
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            from omegaconf import OmegaConf

            self._wandb = wandb.init(
                project=cfg.logging.wandb_project,
                dir=str(self.path),
                mode=cfg.logging.wandb_mode,
                config=OmegaConf.to_container(cfg, resolve=True),
                name=self.path.name,
                resume="allow",
                id=f"{self.path.name}-{_stable_id(self.path)}",
            )
        except Exception as e:  # logging must never cost a training run
            warnings.warn(f"wandb could not start ({e}); metrics still go to metrics.jsonl", stacklevel=1)

    def start_tensorboard(self, cfg, start_step: int) -> None:
        """Event files in tensorboard/ (logging.tensorboard). A resume hides the events logged after its
        checkpoint (purge_step), as trim_metrics sets their lines aside: they are logged again."""
        if not (self.is_main and cfg.logging.tensorboard):
            return
        with self._quietly("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter

            # a fresh start (step 0) hides every earlier event too, as trim_metrics keeps no line
            self._tensorboard = SummaryWriter(str(self.path / "tensorboard"), purge_step=start_step + 1)

    def log_metrics(self, metrics: dict) -> None:
        if not self.is_main:
            return
        self.guard()
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")  # json writes floats with full (round-trip) precision
        if self._wandb is not None:
            with self._quietly("wandb"):
                self._wandb.log(metrics, step=metrics["step"])
        if self._tensorboard is not None:
            with self._quietly("tensorboard"):
                for key, value in metrics.items():
                    if _number(value) and key != "step":
                        self._tensorboard.add_scalar(key, value, metrics["step"])

    def preview_path(self, step: int, i: int) -> Path:
        """The preview of sample.prompts[i] at `step` (asked just before it is written: guarded)."""
        self.guard()
        return self.samples / f"step_{step}_{i}.mp4"

    def log_previews(self, step: int, previews: dict, fps: float) -> None:
        """The previews written at `step`, {prompt index: (prompt, video (T, H, W, 3) in [0, 1])}, as
        preview/<i>: to wandb its mp4 (wandb.Video of an array needs moviepy), to TensorBoard an animated
        GIF (add_video's record; it encodes with moviepy, this with PIL). report.png shows them too."""
        if not self.is_main:
            return
        self.guard()
        if self._wandb is not None and previews:
            with self._quietly("wandb"):
                import wandb

                videos = {
                    f"preview/{i}": wandb.Video(str(self.preview_path(step, i)), caption=prompt, format="mp4")
                    for i, (prompt, _) in previews.items()
                }
                self._wandb.log(videos, step=step)
        if self._tensorboard is not None:
            with self._quietly("tensorboard"):
                for i, (_, video) in previews.items():  # add_video's own call, with the GIF made here
                    summary = _video_summary(f"preview/{i}", video, fps)
                    self._tensorboard._get_file_writer().add_summary(summary, step)
        self.write_report()

    def checkpointed(self) -> None:
        """After a checkpoint is safely written: TensorBoard's events reach the disk; report.png is drawn."""
        if not self.is_main:
            return
        self.guard()
        if self._tensorboard is not None:
            with self._quietly("tensorboard"):
                self._tensorboard.flush()
        self.write_report()

    def write_report(self) -> None:
        self.guard()
        try:
            from configs.report import write_report

            write_report(self.path)
        except Exception as e:  # a picture must never cost a training run
            warnings.warn(f"report.png could not be drawn ({e}); the run goes on", stacklevel=2)

    @contextlib.contextmanager
    def _quietly(self, logger: str):
        """Logging must never cost a training run: if it fails, warn and go on without that logger (one
        warning, not one a step); metrics.jsonl, the record, goes on."""
        try:
            yield
        except Exception as e:
            warnings.warn(f"{logger} failed ({e}); it logs nothing more, metrics.jsonl goes on", stacklevel=3)
            run = getattr(self, f"_{logger}")
            setattr(self, f"_{logger}", None)
            if logger == "wandb" and run is not None:  # its offline files end cleanly
                with contextlib.suppress(Exception):
                    run.finish()

    @property
    def data_report(self) -> Path:
        return self.path / "data_report.jsonl"

    def start_data_report(self, left_out: list[tuple[str, str, str]], start_step: int) -> None:
        """Main rank, at start-up: data_report.jsonl lists every file left out now ((path, category,
        reason), missing and unreadable first), then the files replaced by earlier processes of this run
        up to the step it resumes from (those after it will be replaced, and listed, again), gathered
        from every rank's file. No rank appends before this: the first append follows the first
        training step, whose collectives wait for this rank."""
        if not self.is_main:
            return
        self.guard()
        kept = [
            r
            for r in read_data_report(self.path)
            if r.get("kind") == "replaced" and r.get("step", 0) <= start_step
        ]
        lines = [
            {"kind": "left_out", "path": path, "category": category, "reason": why}
            for path, category, why in left_out
        ] + kept
        tmp = self.path / "data_report.jsonl.tmp"
        self.path.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
        os.replace(tmp, self.data_report)
        for old in self.path.glob("data_report_rank*.jsonl"):
            old.unlink()

    def trim_metrics(self, start_step: int) -> None:
        """Main rank, at start-up: metrics.jsonl keeps the steps up to `start_step` only (an earlier process
        logged steps after the checkpoint this one resumes from, and they are logged again; a fresh start
        keeps none). The whole earlier file is kept beside it as metrics.<time>.jsonl."""
        path = self.path / "metrics.jsonl"
        if not self.is_main or not path.is_file():
            return
        self.guard()
        lines = path.read_text(errors="surrogateescape").splitlines(keepends=True)
        kept = [line for line in lines if _logged_step(line) <= start_step]
        if len(kept) != len(lines):
            stamp, n = time.strftime("%Y%m%d-%H%M%S"), 0
            aside = self.path / f"metrics.{stamp}.jsonl"
            while aside.exists():  # two starts within a second
                n += 1
                aside = self.path / f"metrics.{stamp}-{n}.jsonl"
            path.rename(aside)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept), errors="surrogateescape")
            os.replace(tmp, path)

    def report_replaced(self, rank: int, path: str, reason: str, step: int) -> None:
        """A file that could not be loaded and was replaced by another sample, from the rank that read it.
        One writer per file (rank 0: data_report.jsonl, rank R: data_report_rank<R>.jsonl), so ranks never
        interleave their lines, also on network filesystems where appends from several hosts are not
        atomic."""
        name = "data_report.jsonl" if rank == 0 else f"data_report_rank{rank}.jsonl"
        self.guard()
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / name, "a") as f:
            f.write(
                json.dumps({"kind": "replaced", "path": path, "reason": reason, "step": step, "rank": rank})
                + "\n"
            )

    def finish(self) -> None:
        if self._wandb is not None:
            with self._quietly("wandb"):
                self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            with self._quietly("tensorboard"):
                self._tensorboard.close()
            self._tensorboard = None


def check_loggers(cfg) -> None:
    """Training only (infer.py reads the same recipe and logs nothing): logging.tensorboard=true without
    TensorBoard installed is refused before start-up, not found at the first log."""
    import importlib.util

    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "logging.tensorboard=true needs TensorBoard, which is not installed: pip install -e "
            '".[tensorboard]" (or set logging.tensorboard=false)'
        )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _video_summary(tag: str, video, fps: float, longest: int = 320):
    """The Summary that SummaryWriter.add_video writes: an animated GIF in an Image value (TensorBoard
    plays it as a video). Tiny previews are enlarged (nearest neighbour), large ones shrunk to `longest`."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    frames = (np.clip(np.asarray(video, dtype=np.float32), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    h, w = frames.shape[1:3]
    scale = longest / max(h, w)
    scale = max(1, int(scale)) if scale >= 1 else scale  # whole pixels up, smooth down
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    resample = Image.NEAREST if scale >= 1 else Image.BOX
    images = [Image.fromarray(f).resize(size, resample) for f in frames]
    buffer = io.BytesIO()
    duration = max(20, round(1000 / fps))  # GIF delays are in 10 ms; browsers slow shorter ones down
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    image = Summary.Image(height=size[1], width=size[0], colorspace=3, encoded_image_string=buffer.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=image)])


def _stable_id(path: Path) -> str:
    """The same wandb run id for the same run directory in every process (str hash() is salted)."""
    import hashlib

    return hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a line cut short by a kill counts as after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def read_metrics(path) -> list[dict]:
    with open(Path(path) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_data_report(path) -> list[dict]:
    """Every line of a run's data report: data_report.jsonl, then each rank's file in rank order (a line
    cut short by a kill is skipped)."""
    path = Path(path)
    files = [path / "data_report.jsonl"] + sorted(
        path.glob("data_report_rank*.jsonl"), key=lambda p: int(p.stem.removeprefix("data_report_rank"))
    )
    lines = []
    for file in files:
        if file.is_file():
            for line in file.read_text(errors="surrogateescape").splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    continue
    return lines
