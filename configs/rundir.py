"""The run directory (`run.output_dir`): what a run leaves behind.

config.yaml        the resolved recipe (an earlier, different one is kept as config.<time>.yaml)
metrics.jsonl      one JSON object per logged step: step, loss, lr, step_time, samples_per_s, ...; a resume
                   keeps the lines up to its checkpoint (the whole earlier file as metrics.<time>.jsonl)
checkpoints/       step_<N>/ (torch.distributed.checkpoint) and `latest`
samples/           preview videos written during training
failures/          per-rank records of recent collectives, written when a run fails
wandb/             offline wandb logs (sync later with `wandb sync`)
data_report.jsonl  every file left out at start-up and every file replaced during training, with
                   the reason; data_report_rank<R>.jsonl: the files rank R (R > 0) replaced
run.lock           while a run trains: its host, pid and heartbeat (configs/runlock.py)
"""

import json
import os
import time
import warnings
from pathlib import Path

from configs import save_config, to_yaml


class RunDirectory:
    def __init__(self, path, is_main: bool):
        self.path = Path(path)
        self.is_main = is_main
        self.samples = self.path / "samples"
        self.failures = self.path / "failures"
        self._wandb = None
        if is_main:
            self.samples.mkdir(parents=True, exist_ok=True)

    def write_config(self, cfg) -> None:
        if not self.is_main:
            return
        target = self.path / "config.yaml"
        if target.is_file() and target.read_text() != to_yaml(cfg):
            target.rename(self.path / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
        save_config(cfg, target)

    def start_wandb(self, cfg) -> None:
        if not (self.is_main and cfg.logging.wandb) or cfg.logging.wandb_mode == "disabled":
            return
        try:
            import os

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

    def log_metrics(self, metrics: dict) -> None:
        if not self.is_main:
            return
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")  # json writes floats with full (round-trip) precision
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics["step"])

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
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / name, "a") as f:
            f.write(
                json.dumps({"kind": "replaced", "path": path, "reason": reason, "step": step, "rank": rank})
                + "\n"
            )

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


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
