"""A synthetic captioned video dataset that needs no download: one coloured shape moving in one
direction on a black background, e.g. "a red square moving left".

Clips come in several aspect ratios and lengths, so the demo exercises the buckets (the loader
resizes and crops them like real videos). A fixed set of (colour, shape, direction) combinations is held out of training so that
`scripts/eval_demo.py` can test on prompts the model never saw.
"""

import itertools

import numpy as np

COLORS = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "magenta": (1.0, 0.0, 1.0),
    "cyan": (0.0, 1.0, 1.0),
}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
ASPECT_RATIOS = ((1, 1), (4, 3), (3, 4), (16, 9))  # width : height

ALL_COMBOS = list(itertools.product(COLORS, SHAPES, DIRECTIONS))
# Two held-out combinations per colour, with a different shape/direction pair for each colour.
HELD_OUT = {c for i, c in enumerate(ALL_COMBOS) if (i % 12) in {(i // 12 * 5) % 12, (i // 12 * 5 + 7) % 12}}
TRAIN_COMBOS = [c for c in ALL_COMBOS if c not in HELD_OUT]


def caption(color: str, shape: str, direction: str) -> str:
    return f"a {color} {shape} moving {direction}"


def held_out_prompts() -> list[str]:
    return [caption(*c) for c in ALL_COMBOS if c in HELD_OUT]


def prompt_color(prompt: str) -> str:
    return next(c for c in COLORS if f" {c} " in f" {prompt} ")


def render_clip(color, shape, direction, frames, height, width, rng: np.random.Generator) -> np.ndarray:
    """(frames, height, width, 3) float32 in [0, 1]. The whole motion stays inside the central
    square of the frame, so a centre crop to any aspect ratio keeps the object in view."""
    side = min(height, width)
    radius = side * rng.uniform(0.14, 0.2)
    travel = side * rng.uniform(0.3, 0.4)  # distance covered over the clip
    dx, dy = DIRECTIONS[direction]
    jitter = rng.uniform(-0.05, 0.05, size=2) * side
    cx0 = width / 2 - dx * travel / 2 + jitter[0] * (dx == 0)
    cy0 = height / 2 - dy * travel / 2 + jitter[1] * (dy == 0)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    rgb = np.asarray(COLORS[color], dtype=np.float32)
    video = np.zeros((frames, height, width, 3), dtype=np.float32)
    for f in range(frames):
        progress = f / max(frames - 1, 1)
        u, v = xs - (cx0 + dx * travel * progress), ys - (cy0 + dy * travel * progress)
        if shape == "square":
            mask = (np.abs(u) <= radius) & (np.abs(v) <= radius)
        elif shape == "circle":
            mask = u**2 + v**2 <= radius**2
        else:  # an upward-pointing triangle
            mask = (v >= -radius) & (v <= radius) & (np.abs(u) <= (v + radius) / 2)
        video[f][mask] = rgb
    return video


class SyntheticVideoDataset:
    """Sample i is fully determined by (seed, i): the same on every rank and in every run. Clips are
    min_frames to frames + extra_frames long (min_frames defaults to frames); their shorter side is
    max(height, width). data/dataset.py's SyntheticDataset puts them into buckets."""

    def __init__(self, num_samples: int, frames: int, height: int, width: int, seed: int = 0,
                 extra_frames: int = 4, combos=None, min_frames: int | None = None):
        self.num_samples = num_samples
        self.frames, self.height, self.width = frames, height, width
        self.seed = seed
        self.min_frames = min(min_frames or frames, frames)
        self.extra_frames = extra_frames
        self.combos = list(combos or TRAIN_COMBOS)

    def __len__(self):
        return self.num_samples

    def describe(self, index: int) -> dict:
        """The clip's content and native size, without rendering it."""
        rng = np.random.default_rng((self.seed, index))
        color, shape, direction = self.combos[rng.integers(len(self.combos))]
        aspect_w, aspect_h = ASPECT_RATIOS[rng.integers(len(ASPECT_RATIOS))]
        short = max(self.height, self.width)
        scale = short / min(aspect_w, aspect_h)
        return dict(color=color, shape=shape, direction=direction, caption=caption(color, shape, direction),
                    frames=int(rng.integers(self.min_frames, self.frames + self.extra_frames + 1)),
                    height=int(round(aspect_h * scale)), width=int(round(aspect_w * scale)),
                    render_seed=int(rng.integers(2**31)))

    def render(self, index: int) -> tuple[np.ndarray, str]:
        d = self.describe(index)
        rng = np.random.default_rng(d["render_seed"])
        clip = render_clip(d["color"], d["shape"], d["direction"], d["frames"], d["height"], d["width"], rng)
        return clip, d["caption"]


def dominant_color(video: np.ndarray, threshold: float = 0.35) -> str | None:
    """The palette colour nearest to the mean colour of the object's pixels (those brighter than
    `threshold` in some channel) of a (T, H, W, 3) video in [0, 1]; None if nothing stands out."""
    pixels = video.reshape(-1, 3)
    bright = pixels[pixels.max(axis=1) > threshold]
    if len(bright) < max(4, pixels.shape[0] // 500):
        return None
    mean = bright.mean(axis=0) / max(bright.mean(axis=0).max(), 1e-6)  # brightness-invariant
    names = list(COLORS)
    distances = [np.linalg.norm(mean - np.asarray(COLORS[n])) for n in names]
    return names[int(np.argmin(distances))]


def motion_direction(video: np.ndarray, threshold: float = 0.35) -> str | None:
    """The direction in which the centroid of the bright pixels moves from the first to the last frame."""
    centroids = []
    for frame in (video[0], video[-1]):
        ys, xs = np.nonzero(frame.max(axis=-1) > threshold)
        if len(xs) == 0:
            return None
        centroids.append((xs.mean(), ys.mean()))
    dx, dy = centroids[1][0] - centroids[0][0], centroids[1][1] - centroids[0][1]
    if max(abs(dx), abs(dy)) < 0.5:
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"
