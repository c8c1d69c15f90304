"""Step caching for the flow sampler (sample.cache): skip the transformer calls whose velocity would barely
change, and reuse the last computed velocity instead; single-device code.

The decisions form a fixed plan, computed before the first step from a calibration table and the recipe's
threshold alone: values identical on every rank. So every layout (cfg, ulysses, ring) skips the same
steps with no communication. A decision taken from a rank's own shard could differ between ranks and
leave them waiting in different collectives: a hang. The table (MagCache-like, calibrated once per model
and step count by scripts/calibrate_cache.py) holds, per step, the mean relative change of the guided
velocity and the ratio of its norms; a skipped step reuses the last velocity scaled by those ratios.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path


class CacheError(ValueError):
    """A calibration file that is missing, damaged, or made for another number of steps."""


@dataclass
class Calibration:
    """Per Euler step i of a `steps`-step schedule: change[i] = mean |v_i - v_(i-1)| / |v_(i-1)| (norms over
    each sample's whole latent), magnitude[i] = mean |v_i| / |v_(i-1)|; step 0 has neither (nan)."""

    steps: int
    change: list
    magnitude: list
    source: str = ""  # what it was measured on (recipe, checkpoint, prompts)

    @staticmethod
    def measure(velocities: list, source: str = "") -> "Calibration":
        """From the uncached sampler's guided velocities, one (B, ...) tensor per step."""
        change, magnitude = [math.nan], [math.nan]
        for before, now in zip(velocities, velocities[1:]):
            norm_before = before.flatten(1).float().norm(dim=1)
            change.append(((now - before).flatten(1).float().norm(dim=1) / norm_before).mean().item())
            magnitude.append((now.flatten(1).float().norm(dim=1) / norm_before).mean().item())
        return Calibration(len(velocities), change, magnitude, source)

    def save(self, path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        body = {
            "steps": self.steps,
            "change": self.change,
            "magnitude": self.magnitude,
            "source": self.source,
        }
        Path(path).write_text(json.dumps(body, indent=1))

    @staticmethod
    def load(path) -> "Calibration":
        try:
            body = json.loads(Path(path).read_text())
            found = Calibration(
                int(body["steps"]), list(body["change"]), list(body["magnitude"]), body["source"]
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CacheError(
                f"sample.cache_calibration={path} cannot be read as a calibration ({e}); write one with "
                "python scripts/calibrate_cache.py --config <recipe> --output <file>"
            ) from None
        if not (len(found.change) == len(found.magnitude) == found.steps >= 2):
            raise CacheError(f"sample.cache_calibration={path}: its tables do not have {found.steps} entries")
        return found


@dataclass
class Step:
    compute: bool  # call the transformer
    scale: float  # a skipped step's velocity: the last computed one times this


def plan_steps(calibration: Calibration, steps: int, threshold: float, max_skips: int) -> list[Step]:
    """Which of `steps` steps call the model. From the last computed step on, the calibrated changes add
    up; a step is skipped while their sum stays within `threshold` and at most `max_skips` steps in a row
    were skipped. The first and the last steps always compute."""
    if calibration.steps != steps:
        raise CacheError(
            f"the step-cache calibration was made for {calibration.steps} steps, and this sampling takes "
            f"{steps}: calibrate for {steps} (python scripts/calibrate_cache.py --steps {steps}) or sample "
            f"with {calibration.steps}"
        )
    plan, drift, skipped, scale = [], 0.0, 0, 1.0
    for i in range(steps):
        if 0 < i < steps - 1 and skipped < max_skips and drift + calibration.change[i] <= threshold:
            drift, skipped = drift + calibration.change[i], skipped + 1
            scale *= calibration.magnitude[i]
            plan.append(Step(False, scale))
        else:
            drift, skipped, scale = 0.0, 0, 1.0
            plan.append(Step(True, 1.0))
    return plan


@dataclass
class StepCache:
    """sample.cache as the sampler uses it: the calibration and the recipe's budget."""

    calibration: Calibration
    threshold: float
    max_skips: int

    def plan(self, steps: int) -> list[Step]:
        return plan_steps(self.calibration, steps, self.threshold, self.max_skips)


def step_cache(sample_cfg, steps: int) -> StepCache | None:
    """sample.cache for a sampling of `steps` steps, its calibration read and checked against them (a
    CacheError naming the fix); None for sample.cache=none."""
    if sample_cfg.cache == "none":
        return None
    cache = StepCache(
        Calibration.load(sample_cfg.cache_calibration), sample_cfg.cache_threshold, sample_cfg.cache_max_skips
    )
    cache.plan(steps)  # refuses a calibration made for another step count, before anything starts
    return cache
