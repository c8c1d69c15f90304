"""The run directory (`run.output_dir`): what a run leaves behind.

    config.yaml        the resolved recipe (an earlier, different one is kept as config.<time>.yaml)
    metrics.jsonl      one JSON object per logged step: step, loss, lr, step_time, samples_per_s, ...
    checkpoints/       step_<N>/ (torch.distributed.checkpoint) and `latest`
    samples/           preview videos written during training
    failures/          per-rank records of recent collectives, written when a run fails
    wandb/             offline wandb logs (sync later with `wandb sync`)
"""

import json
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

            self._wandb = wandb.init(project=cfg.logging.wandb_project, dir=str(self.path), mode=cfg.logging.wandb_mode,
                                     config=OmegaConf.to_container(cfg, resolve=True), name=self.path.name,
                                     resume="allow", id=f"{self.path.name}-{_stable_id(self.path)}")
        except Exception as e:  # logging must never cost a training run
            warnings.warn(f"wandb could not start ({e}); metrics still go to metrics.jsonl", stacklevel=1)

    def log_metrics(self, metrics: dict) -> None:
        if not self.is_main:
            return
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")  # json writes floats with full (round-trip) precision
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics["step"])

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _stable_id(path: Path) -> str:
    """The same wandb run id for the same run directory in every process (str hash() is salted)."""
    import hashlib

    return hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]


def read_metrics(path) -> list[dict]:
    with open(Path(path) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]
