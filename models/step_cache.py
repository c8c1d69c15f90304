"""Step caching for the flow sampler (sample.cache): skip transformer work whose output would barely change,
and reuse what the last full call computed instead; single-device code.

`calibrated` (MagCache-like): a fixed plan of whole steps to skip, from a calibration table (written once
per model and step count by scripts/calibrate_cache.py: per step, the mean relative change of the guided
velocity and the ratio of its norms) and the recipe's budget. Its values are identical on every rank, so
every layout skips the same steps with no communication. `first_block` (FBCache-like): every call runs
the first block; when its residual barely changed since the last full call, the other blocks are skipped
and their last residual reused (FirstBlockFamily runs a transformer's blocks around that decision). The
sums behind it are added up over every rank holding a part of the sample (`agree`, an all-reduce set by
parallel/), so all take the same decision. A decision taken from a rank's own shard could differ between
ranks and leave them in different collectives: a hang.
"""

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from models.loop import denoise


class CacheError(ValueError):
    """A calibration file that is missing, damaged, out of range, or made for another sampling (model,
    weights, guidance, schedule, number of steps)."""


# A step whose velocity changed by more than this (relative) is not a measurement of a sane sampling; such
# a step would never be skipped anyway.
MAX_CHANGE = 10.0
HOW_TO_CALIBRATE = "python scripts/calibrate_cache.py --config <recipe> [--checkpoint C] --output <file>"


@dataclass
class Calibration:
    """Per Euler step i of a `steps`-step schedule: change[i] = mean |v_i - v_(i-1)| / |v_(i-1)| (norms over
    each sample's whole latent), magnitude[i] = mean |v_i| / |v_(i-1)|; step 0 has neither (nan)."""

    steps: int
    change: list
    magnitude: list
    source: str = ""  # what it was measured on (recipe, checkpoint, prompts), for people
    # what it is valid for (parallel/compute/cache.py calibration_subject: model, weights, guidance,
    # schedule), compared with the sampling that uses it
    made_for: dict = field(default_factory=dict)

    @staticmethod
    def measure(velocities: list, source: str = "", made_for: dict | None = None) -> "Calibration":
        """From the uncached sampler's guided velocities, one (B, ...) tensor per step."""
        change, magnitude = [math.nan], [math.nan]
        for before, now in zip(velocities, velocities[1:]):
            norm_before = before.flatten(1).float().norm(dim=1)
            change.append(((now - before).flatten(1).float().norm(dim=1) / norm_before).mean().item())
            magnitude.append((now.flatten(1).float().norm(dim=1) / norm_before).mean().item())
        return Calibration(len(velocities), change, magnitude, source, made_for or {})

    def save(self, path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def load(path) -> "Calibration":
        try:
            body = json.loads(Path(path).read_text())
            found = Calibration(
                int(body["steps"]),
                [float(v) for v in body["change"]],
                [float(v) for v in body["magnitude"]],
                body["source"],
                dict(body.get("made_for") or {}),  # {}: written before tessera recorded it
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CacheError(
                f"sample.cache_calibration={path} cannot be read as a calibration ({e}); write one with "
                f"{HOW_TO_CALIBRATE}"
            ) from None
        if not (len(found.change) == len(found.magnitude) == found.steps >= 2):
            raise CacheError(f"sample.cache_calibration={path}: its tables do not have {found.steps} entries")
        found.check_values(path)
        return found

    def check_values(self, path) -> None:
        """Every entry after step 0 is finite and possible. A skipped step's velocity is the last one times
        the magnitudes since, so one extreme magnitude (1e30) would make a NaN video. A measured table
        always has |magnitude - 1| <= change (the triangle inequality, sample by sample, then in the mean)
        and 0 <= change <= MAX_CHANGE."""
        for i in range(1, self.steps):
            change, magnitude = self.change[i], self.magnitude[i]
            if not (math.isfinite(change) and 0 <= change <= MAX_CHANGE):
                wrong = f"change[{i}] is {change!r}, outside [0, {MAX_CHANGE:g}]"
            elif not (math.isfinite(magnitude) and abs(magnitude - 1) <= change + 1e-4):  # float32 norms
                wrong = (
                    f"magnitude[{i}] is {magnitude!r}, outside 1 +- change[{i}] ({change!r}), which a "
                    "measured table never is"
                )
            else:
                continue
            raise CacheError(
                f"sample.cache_calibration={path}: {wrong}; the file is damaged or was not measured: "
                f"calibrate again ({HOW_TO_CALIBRATE})"
            )

    def check_made_for(self, subject: dict, path) -> None:
        """Refuse a calibration measured on another sampling than `subject` (calibration_subject's answer for
        this run), naming each difference."""
        if not self.made_for:
            raise CacheError(
                f"sample.cache_calibration={path} does not record what it was made for (an older tessera "
                "wrote it), so it cannot be checked against this sampling: calibrate again "
                f"({HOW_TO_CALIBRATE})"
            )
        differs = _differences(self.made_for, subject)
        if differs:
            raise CacheError(
                f"sample.cache_calibration={path} was made for another sampling: {'; '.join(differs)}. A "
                "calibration belongs to the model, weights, guidance and schedule it was measured on: "
                f"calibrate for this one ({HOW_TO_CALIBRATE}), or sample what it was made for"
            )


# what a calibration written before a key was recorded was made for
ADDED_LATER = {"base_dtype": "auto", "conditioning": {"what": "the family's defaults", "id": "{}"}}


def _differences(theirs: dict, ours: dict) -> list[str]:
    """'key: X there, Y here' for each entry of `ours` that `theirs` (a calibration's record) does not
    share. An identity {"what", "id"} compares by id (a file moved elsewhere is still the same) and shows
    what; another dict (the architecture) compares entry by entry."""
    out = []
    for key, mine in ours.items():
        other = theirs.get(key, ADDED_LATER.get(key))
        if isinstance(mine, dict) and "id" in mine:
            if not isinstance(other, dict) or other.get("id") != mine["id"]:
                shown = other.get("what") if isinstance(other, dict) else other
                out.append(f"{key}: {shown} there, {mine['what']} here")
        elif isinstance(mine, dict):
            other = other if isinstance(other, dict) else {}
            out += [
                f"{key}.{k}: {other.get(k)!r} there, {v!r} here" for k, v in mine.items() if other.get(k) != v
            ]
        elif other != mine:
            out.append(f"{key}: {other!r} there, {mine!r} here")
    return out


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


class CachedVelocity:
    """velocity(x, t) behind a step cache, for models/loop.py: its k-th call is step k. A step the plan
    computes calls `velocity` (after the cache's begin_step); a skipped one reuses the last computed
    velocity times the plan's scale (both guidance branches are skipped together: it is the guided one).
    `calls`: how many steps called the model."""

    def __init__(self, velocity, cache, steps: int):
        self.velocity, self.cache, self.steps = velocity, cache, steps
        self.plan = cache.plan(steps)  # the calibration and the budget alone: the same on every rank
        self.step, self.calls, self.last = 0, 0, None

    def __call__(self, x, t):
        i, self.step = self.step, self.step + 1
        if i == 0:
            self.cache.start(self.steps, x.shape[0])
        if self.plan[i].compute:
            self.cache.begin_step(i)
            self.last, self.calls = self.velocity(x, t), self.calls + 1
            return self.last
        return self.last * self.plan[i].scale


@dataclass
class StepCache:
    """sample.cache=calibrated as the sampler uses it: the calibration and the recipe's budget."""

    calibration: Calibration
    threshold: float
    max_skips: int
    method = "calibrated"

    def plan(self, steps: int) -> list[Step]:
        return plan_steps(self.calibration, steps, self.threshold, self.max_skips)

    def start(self, steps: int, samples: int) -> None:
        """A new sampling of `samples` samples in `steps` steps (the flow sampler calls it)."""
        self.full_calls = sum(step.compute for step in self.plan(steps))

    def begin_step(self, step: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def fingerprint(self, steps: int) -> int:
        """What decides this rank's skips and their scales: one number the ranks compare before sampling."""
        plan = [(s.compute, round(s.scale, 9)) for s in self.plan(steps)]
        return zlib.crc32(repr((self.method, self.threshold, self.max_skips, plan)).encode())


class FirstBlockCache:
    """sample.cache=first_block. Per sample, over both guidance branches: change = sum |r - r_full| / sum
    |r_full| over the tokens, where r is this call's first-block residual and r_full that of the last call
    that ran every block for the sample (ParaAttention's FBCache rule). A sample reuses the other blocks'
    last residual when change < threshold and fewer than max_skips calls in a row reused it; the first
    and the last steps run every block. Decided per sample, and only the samples that do not reuse run
    the other blocks (a smaller batch), so a video does not depend on the prompts that share its batch."""

    method = "first_block"

    def __init__(self, threshold: float, max_skips: int):
        self.threshold, self.max_skips = threshold, max_skips
        # sums -> the same sums added over every rank holding a part of the sample (parallel/ sets it)
        self.agree = lambda sums: sums
        self.start(1, 1)

    def plan(self, steps: int) -> list[Step]:
        return [Step(True, 1.0)] * steps  # every step calls the model; the blocks decide inside it

    def start(self, steps: int, samples: int) -> None:
        self.steps, self.samples, self.step = steps, samples, 0
        self.previous = self.rest = None  # r_full, and the other blocks' residual, per row
        self.skipped = torch.zeros(samples, dtype=torch.long)  # calls in a row that reused, per sample
        self.sample_calls = 0  # calls x samples that ran every block
        self.decisions = []  # per call: which samples reused (the ranks compare them at the end)

    @property
    def full_calls(self) -> float:
        """Calls that ran every block, per sample (their mean when samples decided differently)."""
        return self.sample_calls / self.samples

    def begin_step(self, step: int) -> None:
        self.step = step

    def finish(self) -> None:
        """Sampling is done: free the stored residuals (GBs at Wan-14B 720p) before the VAE decodes."""
        self.previous = self.rest = self._residual = None

    def fingerprint(self, steps: int) -> int:
        return zlib.crc32(repr((self.method, self.threshold, self.max_skips, steps)).encode())

    @torch.compiler.disable  # `agree` is a collective under sequence or cfg parallelism
    def decide(self, residual: torch.Tensor, valid: int) -> torch.Tensor | None:
        """The rows that run the other blocks (a LongTensor, the same on every rank; None: all of them), from
        the first block's residual (rows, n, D): rows = guidance branches x samples on this rank, in that
        order; the first `valid` of its n tokens are real (the rest pad a sequence-parallel shard)."""
        self._residual = residual
        if self.previous is None or self.step == self.steps - 1 or not (self.skipped < self.max_skips).any():
            reuse = torch.zeros(self.samples, dtype=torch.bool)  # the same on every rank: no sums
        else:
            now, before = residual[:, :valid], self.previous[:, :valid]
            l1 = lambda r: torch.linalg.vector_norm(r, 1, dim=(1, 2), dtype=torch.float32)  # noqa: E731
            sums = torch.stack((l1(now - before), l1(before)), 1)  # (rows, 2), float32 sums of bf16 on a GPU
            sums = self.agree(sums.double().view(-1, self.samples, 2).sum(0)).cpu()  # (samples, 2)
            change = sums[:, 0] / sums[:, 1]  # nan (never reused) where the residual is all zeros
            reuse = (change < self.threshold) & (self.skipped < self.max_skips)
        self.decisions.append(reuse.tolist())
        self.skipped = torch.where(reuse, self.skipped + 1, 0)
        self.sample_calls += int((~reuse).sum())
        if not reuse.any():
            return None
        rows = (~reuse).repeat(residual.shape[0] // self.samples)
        return rows.nonzero().flatten().to(residual.device)

    def combine(self, first: torch.Tensor, out: torch.Tensor, run: torch.Tensor | None) -> torch.Tensor:
        """The blocks' output for every row: `out` (the other blocks' output for the rows `run`) where they
        ran, the first block's output plus the stored residual elsewhere. Stores what the next call
        compares against."""
        if run is None:
            self.previous, self.rest = self._residual, out - first
            return out
        full = first + self.rest
        if len(run):
            full[run] = out
            self.rest[run] = out - first[run]
            self.previous[run] = self._residual[run]
        return full


class FirstBlockFamily:
    """A family's transformer (models/family.py; tessera's DiT too) with sample.cache=first_block, called
    once per step with every guidance branch's conditioning: each branch's first block, one decision per
    sample over all of them (FirstBlockCache), then the other blocks on the samples that must run them. It
    calls the pieces PipeFusion calls (embed, patch_context, companion, patch_blocks, patch_final,
    unpatchify) and the context's `rows`, on this rank's share of the tokens (the model's `sequence`: the
    whole sequence on one device, a shard under ulysses or ring, its operators made split by parallel/)."""

    def __init__(self, model, cache: FirstBlockCache):
        self.model, self.cache = model, cache

    def __call__(self, x, t, *conds) -> list:
        """The transformer's output for each conditioning in `conds` (the branches, in the cache's order)."""
        model, cache = self.model, self.cache
        whole, grid = model.embed(x)
        tokens = model.sequence.shard(whole, None)[0]
        local, n = tokens.shape[1], whole.shape[1]
        span = (model.sequence.start(local), model.sequence.start(local) + local)  # past n: padding
        passes, residuals, valid = [], [], model.sequence.valid_tokens(local)
        for cond in conds:
            ctx = model.patch_context(t, cond, grid)
            companion = model.companion(ctx)
            first, side = model.patch_blocks([0], tokens, companion, ctx, grid, *span)
            passes.append((ctx, first, side))
            residuals.append(self._residual(ctx, first - tokens, companion, side, valid, span[0]))
        first = torch.cat([p[1] for p in passes])  # rows: branches x samples, as FirstBlockCache reads them
        residual = torch.cat(residuals)
        rows = cache.decide(residual, residual.shape[1])
        run = None if rows is None else rows[: len(rows) // len(conds)]  # the same samples in each branch
        out = first[:0]
        if run is None or len(run):
            out = torch.cat([self._rest(ctx, f, side, grid, run, span) for ctx, f, side in passes])
        tokens = cache.combine(first, out, rows).chunk(len(conds))
        final = lambda b, ctx: model.patch_final(model.sequence.gather(b), ctx, 0, n)  # noqa: E731
        return [model.unpatchify(final(b, p[0]), grid) for b, p in zip(tokens, passes)]

    @staticmethod
    def _residual(ctx, residual, companion, side, valid: int, start: int):
        """The first block's residual the rule compares: of this rank's real image tokens, then of the
        reference tokens that passed beside them (`ctx.beside`, whole on every rank: counted on the
        first shard's), the image stream's last tokens in diffusers' transformers."""
        beside = getattr(ctx, "beside", 0)  # the families with reference images
        residual = residual[:, :valid]
        if not beside or start != 0:
            return residual
        return torch.cat([residual, side[:, -beside:] - companion[:, -beside:]], dim=1)

    def _rest(self, ctx, first, side, grid, run, span):
        """The blocks after the first on the samples `run` (None: all) of one branch."""
        if run is not None:
            ctx, first, side = ctx.rows(run), first[run], None if side is None else side[run]
        rest = range(1, len(self.model.blocks))
        return self.model.patch_blocks(rest, first, side, ctx, grid, *span)[0]


def walk_cached(cache, schedule, noise, velocity, progress=None) -> tuple:
    """(the latents at the schedule's end, the steps that ran every block): models/loop.py's loop, behind
    the step cache when there is one (`cache`: step_cache's answer, or None). Its one home: every
    family's walk passes here."""
    steps = len(schedule.timesteps)
    if cache is None:
        return denoise(schedule, noise, velocity, progress), steps
    velocity = CachedVelocity(velocity, cache, steps)
    x = denoise(schedule, noise, velocity, progress)
    cache.finish()
    return x, cache.full_calls if cache.method == "first_block" else velocity.calls  # first_block: per sample


def step_cache(sample_cfg, steps: int):
    """sample.cache for a sampling of `steps` steps (a StepCache with its calibration read and checked
    against them, a CacheError naming the fix; or a FirstBlockCache); None for sample.cache=none."""
    if sample_cfg.cache == "none":
        return None
    if sample_cfg.cache == "first_block":
        return FirstBlockCache(sample_cfg.cache_first_block_threshold, sample_cfg.cache_max_skips)
    cache = StepCache(
        Calibration.load(sample_cfg.cache_calibration), sample_cfg.cache_threshold, sample_cfg.cache_max_skips
    )
    cache.plan(steps)  # refuses a calibration made for another step count, before anything starts
    return cache
