"""A synthetic captioned video dataset that needs no download: one coloured shape moving in one
direction on a black background, e.g. "a red square moving left".

Clips come in several aspect ratios and lengths, so the demo exercises the buckets (the loader
resizes and crops them like real videos). A fixed set of (colour, shape, direction) combinations is held out
of training so that
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
# Colours the demo model never sees: scripts/demo_lora.sh teaches one with a LoRA (data.synthetic_colors).
NEW_COLORS = {"orange": (1.0, 0.5, 0.0)}
PALETTE = {**COLORS, **NEW_COLORS}
# A new colour's held-out combinations: one per direction, the shapes in turn.
NEW_HELD_OUT = {(c, SHAPES[i % len(SHAPES)], d) for c in NEW_COLORS for i, d in enumerate(DIRECTIONS)}


def check_colors(colors) -> list[str]:
    unknown = [c for c in colors if c not in PALETTE]
    if unknown or not colors:
        raise ValueError(
            f"data.synthetic_colors: {unknown or 'empty'} is not a colour of the synthetic generator; "
            f"choose from {list(PALETTE)}"
        )
    return list(colors)


def train_combos(colors=None) -> list[tuple[str, str, str]]:
    """The training combinations of `colors` (default: the demo's six), held-out ones left out."""
    colors = check_colors(colors) if colors else list(COLORS)
    held_out = HELD_OUT | NEW_HELD_OUT
    return [c for c in itertools.product(colors, SHAPES, DIRECTIONS) if c not in held_out]


def caption(color: str, shape: str, direction: str) -> str:
    return f"{'an' if color[0] in 'aeiou' else 'a'} {color} {shape} moving {direction}"


def held_out_prompts(colors=None) -> list[str]:
    """The prompts never trained on: the demo's (default), or those of `colors` (new ones included)."""
    if not colors:
        return [caption(*c) for c in ALL_COMBOS if c in HELD_OUT]
    combos = itertools.product(check_colors(colors), SHAPES, DIRECTIONS)
    return [caption(*c) for c in combos if c in HELD_OUT | NEW_HELD_OUT]


def prompt_color(prompt: str) -> str:
    return next(c for c in PALETTE if f" {c} " in f" {prompt} ")


def render_clip(
    color, shape, direction, frames, height, width, rng: np.random.Generator, span: int | None = None
) -> np.ndarray:
    """(frames, height, width, 3) float32 in [0, 1]. The object moves at a constant speed per frame, so
    any first-k-frames crop (what a bucket takes) shows the same motion; it is large and fast so that
    shape and direction are visible at the demo's 24 pixels and a few frames. Its path over the first
    `span` frames (default: all) stays inside the central square of the frame, so a centre crop to any
    aspect ratio keeps it in view; frames beyond `span` (never used by a bucket) may leave it."""
    side = min(height, width)
    span = max(min(span or frames, frames), 2)
    # Size, speed and path vary only a little: the caption then nearly fixes the clip, so a model trained
    # for minutes on a CPU learns one coherent object on its path instead of scattered fragments. Half the
    # side wide, so that corners (square or not) span pixels a small model draws: at 0.19-0.21 squares came
    # out rounded more often (docs/benchmarks_history.md, issue 13).
    radius = side * rng.uniform(0.24, 0.26)
    # About 1.6 px a frame at 24 px: 0.07-0.08 of the side, capped so the path over `span` frames fits beside
    # the object.
    step = min(side * rng.uniform(0.07, 0.08), (side - 2 * radius - 1) / (span - 1))
    travel = step * (span - 1)
    dx, dy = DIRECTIONS[direction]
    jitter = rng.uniform(-0.04, 0.04, size=2) * side
    cx0 = width / 2 - dx * travel / 2 + jitter[0] * (dx == 0)
    cy0 = height / 2 - dy * travel / 2 + jitter[1] * (dy == 0)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    rgb = np.asarray(PALETTE[color], dtype=np.float32)
    video = np.zeros((frames, height, width, 3), dtype=np.float32)
    for f in range(frames):
        u, v = xs - (cx0 + dx * step * f), ys - (cy0 + dy * step * f)
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

    def __init__(
        self,
        num_samples: int,
        frames: int,
        height: int,
        width: int,
        seed: int = 0,
        extra_frames: int = 4,
        combos=None,
        min_frames: int | None = None,
    ):
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
        return dict(
            color=color,
            shape=shape,
            direction=direction,
            caption=caption(color, shape, direction),
            frames=int(rng.integers(self.min_frames, self.frames + self.extra_frames + 1)),
            height=int(round(aspect_h * scale)),
            width=int(round(aspect_w * scale)),
            render_seed=int(rng.integers(2**31)),
        )

    def render(self, index: int) -> tuple[np.ndarray, str]:
        d = self.describe(index)
        rng = np.random.default_rng(d["render_seed"])
        clip = render_clip(
            d["color"],
            d["shape"],
            d["direction"],
            d["frames"],
            d["height"],
            d["width"],
            rng,
            span=self.frames,
        )  # buckets take at most self.frames frames
        return clip, d["caption"]


# Reading a clip back, from its pixels alone: what scripts/eval_demo.py judges generated clips with and
# what tests check against the generator. A pixel is "bright" when its brightest channel exceeds
# BRIGHT (the background is black, objects are saturated). A frame is coherent when its largest
# 4-connected bright component holds at least COHERENT of the frame's bright pixels and at least
# MIN_AREA and at most MAX_AREA of its area (an object covers at most ~25% of the frame here: a larger
# bright region is a lit background, not an object); a clip is coherent when every frame is and that
# component's area stays within a factor AREA_RATIO of the clip's median (no shrinking or flickering object).
BRIGHT = 0.5
COHERENT = 0.8
MIN_AREA = 0.01
MAX_AREA = 0.35
AREA_RATIO = 2.0


def label_components(mask: np.ndarray) -> np.ndarray:
    """4-connected components of a (H, W) bool mask: int labels, 0 for background. Propagates the
    smallest flat index through each component (numpy only; a few dozen sweeps at demo sizes)."""
    h, w = mask.shape
    big = h * w + 1
    labels = np.where(mask, np.arange(1, h * w + 1).reshape(h, w), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        nearest = np.minimum.reduce(
            [labels, padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:]]
        )
        nearest = np.where(mask, nearest, big)
        if np.array_equal(nearest, labels):
            return np.where(mask, labels, 0)
        labels = nearest


def largest_component(frame: np.ndarray, threshold: float = BRIGHT) -> tuple[np.ndarray, int]:
    """(mask of the largest bright component, number of bright pixels) of a (H, W, 3) frame."""
    bright = frame.max(axis=-1) > threshold
    if not bright.any():
        return bright, 0
    labels = label_components(bright)
    ids, counts = np.unique(labels[bright], return_counts=True)
    return labels == ids[np.argmax(counts)], int(bright.sum())


def fill_holes(mask: np.ndarray) -> np.ndarray:
    """The mask with every enclosed hole filled: dark specks inside an object are texture, not outline."""
    padded = np.pad(mask, 1)
    labels = label_components(~padded)
    outside = labels == labels[0, 0]  # the background connected to the border
    return ~outside[1:-1, 1:-1]


def shape_templates(height: int, width: int, cy: float, cx: float, area: float) -> dict:
    """Masks of the three shapes as render_clip draws them (axis-aligned, triangle apex up), each of the
    given area with its centroid at (cy, cx), on a (height, width) pixel grid."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
    side = np.sqrt(area) / 2  # half the square's side
    radius = np.sqrt(area / np.pi)
    half = np.sqrt(area / 2)  # the triangle's half height (its base is as wide as it is high)
    v = ys - (cy - half / 3)  # a triangle's centroid lies a third of its half height below its box's middle
    return {
        "square": (np.abs(ys - cy) <= side) & (np.abs(xs - cx) <= side),
        "circle": (ys - cy) ** 2 + (xs - cx) ** 2 <= radius**2,
        "triangle": (v >= -half) & (v <= half) & (np.abs(xs - cx) <= (v + half) / 2),
    }


SHAPE_IOU = 0.6  # below this overlap with the best template a component has no shape (rendered ones: >= 0.95)


def classify_shape(mask: np.ndarray) -> str | None:
    """square, circle or triangle: the shape whose template of the same area, placed on the component's
    centroid, overlaps it best (intersection over union), if that overlap reaches SHAPE_IOU; else None.
    Holes are filled first (specks inside are texture, not outline); a stray pixel at the edge moves the
    answer little, where a bounding box would jump."""
    mask = fill_holes(mask)
    ys, xs = np.nonzero(mask)
    if len(ys) < 4:
        return None
    templates = shape_templates(*mask.shape, ys.mean() + 0.5, xs.mean() + 0.5, float(len(ys)))
    overlap = {name: (templates[name] & mask).sum() / (templates[name] | mask).sum() for name in SHAPES}
    best = max(SHAPES, key=overlap.get)
    return best if overlap[best] >= SHAPE_IOU else None


def read_clip(video: np.ndarray, threshold: float = BRIGHT, palette=COLORS) -> dict:
    """What a (T, H, W, 3) clip in [0, 1] shows: the object's colour (`palette` colour nearest to the mean
    of its largest component's pixels), shape (the most frequent over frames; None on a tie), direction
    (the sign of the larger least-squares slope of that component's centroid over frames, if it moves at
    least a pixel over the clip) and whether it is coherent (see COHERENT above). Fields are None where
    nothing can be read."""
    frames, height, width = video.shape[:3]
    masks, fractions, areas = [], [], []
    for frame in video:
        mask, total = largest_component(frame, threshold)
        masks.append(mask)
        areas.append(int(mask.sum()))
        fractions.append(areas[-1] / total if total else 0.0)
    median = float(np.median(areas))
    coherent = bool(
        MIN_AREA * height * width <= median <= MAX_AREA * height * width
        and min(fractions) >= COHERENT
        and all(median / AREA_RATIO <= a <= median * AREA_RATIO for a in areas)
    )
    out = {
        "coherent": coherent,
        "color": None,
        "shape": None,
        "direction": None,
        "min_fraction": round(min(fractions), 3),
        "areas": areas,
    }
    if not any(areas):
        return out
    pixels = video[np.stack(masks)]
    mean = pixels.mean(axis=0) / max(pixels.mean(axis=0).max(), 1e-6)  # brightness-invariant
    out["color"] = min(palette, key=lambda n: np.linalg.norm(mean - np.asarray(palette[n])))
    shapes = [classify_shape(m) for m in masks if m.any()]
    shapes = [s for s in shapes if s]
    counts = sorted((shapes.count(s), s) for s in SHAPES)
    if counts[-1][0] > counts[-2][0]:  # the frames' most frequent reading; a tie reads as no shape
        out["shape"] = counts[-1][1]
    seen = [f for f in range(frames) if areas[f]]
    if len(seen) >= 2:
        t = np.asarray(seen, dtype=np.float64)
        cx = np.array([np.nonzero(masks[f])[1].mean() for f in seen])
        cy = np.array([np.nonzero(masks[f])[0].mean() for f in seen])
        sx, sy = np.polyfit(t, cx, 1)[0], np.polyfit(t, cy, 1)[0]
        if max(abs(sx), abs(sy)) * (frames - 1) >= 1.0:
            out["direction"] = (
                ("right" if sx > 0 else "left") if abs(sx) >= abs(sy) else ("down" if sy > 0 else "up")
            )
    return out
