"""Aspect-ratio and frame-count buckets: every sample trains at a (frames, height, width) that fits it.

A bucket is a pixel size (frames, height, width) that the VAE strides and the patch size divide.
A recipe declares resolution classes (a pixel budget each, written as the side of the square of
that area: 256 means 256 x 256 pixels), aspect ratios (width:height) and frame counts (1 is an
image); the buckets are every combination, snapped to the nearest valid size. A sample goes to the
bucket with the nearest aspect ratio, the longest frame count its clip holds and the largest
resolution class it reaches without being enlarged by more than `data.max_upscale`. Each bucket's
batch size comes from a token budget (`data.tokens_per_batch`), so no table is tuned by hand.

With none of these keys set a recipe has exactly one bucket: data.frames x data.height x data.width.
"""

import math
from collections import Counter
from dataclasses import dataclass

from configs import parse_aspect_ratio
from data.media import frames_at_rate
from models.vae import num_tokens


@dataclass(frozen=True, order=True)
class Bucket:
    frames: int
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"


def _snap(size: float, multiple: int) -> int:
    return max(multiple, round(size / multiple) * multiple)


class BucketTable:
    """The buckets of a recipe, their batch sizes, and the rule that assigns a sample to one."""

    def __init__(self, data_cfg, latent_space, patch_size, default_batch_size: int):
        pt, ph, pw = patch_size
        side_h, side_w = latent_space.spatial_stride * ph, latent_space.spatial_stride * pw
        self.max_upscale = float(data_cfg.max_upscale)  # signs and ranges: checked by configs.validate
        ratios = [parse_aspect_ratio(r) for r in data_cfg.aspect_ratios] or [data_cfg.width / data_cfg.height]
        budgets = [r * r for r in data_cfg.resolutions] or [data_cfg.height * data_cfg.width]
        frame_counts = sorted(set(data_cfg.frame_counts or [data_cfg.frames]))
        for frames in frame_counts:  # the VAE's rule, with its own suggestion of valid counts
            try:
                latent_space.latent_shape(frames, side_h, side_w, patch_size)
            except ValueError as e:
                raise ValueError(f"data.frame_counts: {e}") from None
        self.ratios, self.frame_counts = sorted(set(ratios)), frame_counts
        # (ratio index, budget index) -> pixel size, budgets ascending
        self.sizes = {
            (a, b): (_snap(math.sqrt(budget / ratio), side_h), _snap(math.sqrt(budget * ratio), side_w))
            for a, ratio in enumerate(self.ratios)
            for b, budget in enumerate(sorted(budgets))
        }
        self.buckets = sorted({Bucket(f, h, w) for f in frame_counts for (h, w) in self.sizes.values()})
        self.index = {b: i for i, b in enumerate(self.buckets)}
        self.latent_shapes = [
            latent_space.latent_shape(b.frames, b.height, b.width, patch_size) for b in self.buckets
        ]
        self.tokens = [num_tokens(shape, patch_size) for shape in self.latent_shapes]
        budget = data_cfg.tokens_per_batch
        sizes = [max(1, budget // t) if budget else default_batch_size for t in self.tokens]
        self.batch_sizes = [min(s, data_cfg.max_batch_size) if data_cfg.max_batch_size else s for s in sizes]

    def __len__(self):
        return len(self.buckets)

    def assign(
        self,
        width: int,
        height: int,
        num_frames: int,
        source_fps: float | None = None,
        target_fps: float | None = None,
    ) -> tuple[int | None, str]:
        """(bucket index, '') or (None, why the sample fits no bucket)."""
        if width < 1 or height < 1 or num_frames < 1:
            return None, "no size or frame count"
        available = frames_at_rate(num_frames, source_fps, target_fps)
        frames = [f for f in self.frame_counts if f <= available]
        if not frames:
            if target_fps and source_fps and abs(source_fps - target_fps) > 1e-6:  # resampled to data.fps
                n = self.frame_counts[0]
                return None, f"too short at data.fps={target_fps:g} (its span holds fewer than {n} frames)"
            return None, f"too short (fewer than {self.frame_counts[0]} frames)"
        ratio = width / height
        a = min(range(len(self.ratios)), key=lambda i: abs(math.log(self.ratios[i] / ratio)))
        fitting = [
            (h, w)
            for (ai, _), (h, w) in self.sizes.items()
            if ai == a and max(h / height, w / width) <= self.max_upscale + 1e-9
        ]
        if not fitting:
            return None, f"too small (would need more than {self.max_upscale:g}x upscaling)"
        h, w = fitting[-1]  # the largest class it reaches (budgets are ascending)
        return self.index[Bucket(frames[-1], h, w)], ""

    def describe(self, counts: Counter | None = None) -> str:
        lines = []
        for i, b in enumerate(self.buckets):
            samples = f", {counts.get(i, 0)} samples" if counts is not None else ""
            lines.append(f"  {b.name:>14}: {self.tokens[i]} tokens, batch {self.batch_sizes[i]}{samples}")
        return "\n".join(lines)


def describe_mix(mix: dict) -> str:
    """The three most frequent buckets of a window, as shares: '8x32x32 50% 4x28x36 30% ...'."""
    total = sum(mix.values()) or 1
    top = sorted(mix.items(), key=lambda kv: -kv[1])
    more = " ..." if len(top) > 3 else ""
    return " ".join(f"{name} {100 * n / total:.0f}%" for name, n in top[:3]) + more
