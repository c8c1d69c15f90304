"""report.png: a run judged at a glance, without a dashboard (configs/rundir.py draws it at each checkpoint
and after each preview). Its curves come from metrics.jsonl, the record: loss (raw, and an EMA to smooth
it), learning rate, gradient norm and throughput over steps; below them, a strip of frames of each video of
the newest preview in samples/ (decoded with PyAV: configs/ sits below data/ and its reader)."""

import json
import math
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from configs.plot import Axes, load_font

WIDTH, PANEL_H, FRAME_H, MAX_FRAMES, MAX_ROWS, MAX_POINTS = 1000, 240, 112, 8, 4, 2000
# (metrics.jsonl key, panel title, colour, y axis from 0); the loss panel adds its smoothed curve
PANELS = (
    ("loss", "loss (thin: each logged step; thick: smoothed)", "#9bb7d4", False),
    ("lr", "learning rate", "#2a7f3f", True),
    ("grad_norm", "gradient norm (before clipping)", "#b3541e", False),
    ("tokens_per_s", "throughput, tokens/s", "#6a3d9a", True),  # from 0: a 5% wobble looks like 5%
)
PREVIEW = re.compile(r"step_(\d+)_(\d+)\.mp4")


def write_report(run_dir) -> Path:
    """Draw <run_dir>/report.png from the run's files (written whole: a reader never sees half an image)."""
    run_dir = Path(run_dir)
    metrics = read_lines(run_dir / "metrics.jsonl")
    logged = metrics[-1]["step"] if metrics else None  # previews after it belong to a set-aside process
    step, previews = newest_previews(run_dir / "samples", logged)
    rows = [(i, frame_strip(path)) for i, path in previews[:MAX_ROWS]]
    prompts = preview_prompts(run_dir)
    font = load_font(13)
    height = 40 + 2 * PANEL_H + sum(strip.height + 28 for _, strip in rows) + 10
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((12, 10), headline(run_dir, metrics), fill="black", font=load_font(16))
    for n, (key, title, colour, from_zero) in enumerate(PANELS):
        left, top = 80 + (n % 2) * (WIDTH // 2), 40 + (n // 2) * PANEL_H + 24
        box = (left, top, left + WIDTH // 2 - 110, top + PANEL_H - 64)
        draw_panel(draw, box, metrics, key, (title, colour, from_zero), font)
    y = 40 + 2 * PANEL_H
    for i, strip in rows:
        prompt = prompts[i] if i < len(prompts) else f"prompt {i}"
        caption = f"preview at step {step}, sample.prompts[{i}]: {prompt}"
        draw.text((12, y + 6), caption, fill="black", font=font)
        image.paste(strip, (12, y + 24))
        y += strip.height + 28
    tmp = run_dir / "report.png.tmp"
    image.save(tmp, format="PNG")
    os.replace(tmp, run_dir / "report.png")
    return run_dir / "report.png"


def read_lines(path: Path, most: int = MAX_POINTS) -> list[dict]:
    """metrics.jsonl's lines (one cut short by a kill is left out), at most `most` of them, evenly spaced
    and the last always: drawn at every checkpoint, the report must cost the same at step 10^6 as at 10^3
    (the other ranks do not wait for it). None when there is no file yet."""
    if not path.is_file():
        return []
    text = path.read_text(errors="surrogateescape").splitlines()
    if len(text) > most:
        picked = np.unique(np.linspace(0, len(text) - 1, most).round().astype(int))
        text = [text[i] for i in picked]
    lines = []
    for line in text:
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return [m for m in lines if isinstance(m, dict) and "step" in m]


def headline(run_dir: Path, metrics: list[dict]) -> str:
    if not metrics:
        return f"{run_dir.name}: nothing logged yet"
    last = metrics[-1]
    names = {"loss": "loss", "lr": "lr", "samples_per_s": "samples/s"}
    values = ", ".join(f"{name} {short(last[k])}" for k, name in names.items() if _number(last.get(k)))
    return f"{run_dir.name}: step {last['step']}; {values}"


def ema(values: list[float], span: int) -> list[float]:
    """The exponential moving average of the finite values (NaN where a value is not), debiased so that
    its start is not pulled towards 0: the smoothing TensorBoard applies."""
    alpha, mean, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        if math.isfinite(v):
            mean, weight = (1 - alpha) * mean + alpha * v, (1 - alpha) * weight + alpha
        out.append(mean / weight if weight else math.nan)
    return out


def draw_panel(draw, box, metrics: list[dict], key: str, look: tuple, font) -> None:
    """One metric over steps; look: (title, colour, whether the y axis starts at 0)."""
    title, colour, from_zero = look
    points = [(m["step"], float(m[key])) for m in metrics if _number(m.get(key))]
    finite = [v for _, v in points if math.isfinite(v)]
    if not finite:
        Axes(draw, box, (0, 1), (0, 1), font).frame(f"{title}: not logged yet")
        return
    steps, values = [s for s, _ in points], [v for _, v in points]
    low = min(0.0, *finite) if from_zero else min(finite)
    axes = Axes(draw, box, (min(steps), max(steps)), (low, max(finite)), font)
    axes.frame(f"{title}: {short(finite[-1])} at step {steps[-1]}")
    axes.y_ticks([axes.y0, axes.y1], short, grid="#e4e4e4")
    axes.x_ticks([axes.x0, axes.x1], "{:.0f}")
    axes.line(steps, values, colour)
    if key == "loss":  # the trend under single-batch noise (random timesteps): ~1/50 of the run per span
        axes.line(steps, ema(values, max(5, len(values) // 50)), "#123e6b", width=2)


def newest_previews(samples: Path, up_to=None) -> tuple[int | None, list[tuple[int, Path]]]:
    """(the newest preview step, [(prompt index, its mp4)]) in samples/, at most `up_to` (the last logged
    step: a resumed run's samples/ still holds the previews of the process it replaced); (None, [])
    before the first."""
    names = [PREVIEW.fullmatch(p.name) for p in samples.glob("step_*.mp4")]
    found = [(int(m[1]), int(m[2]), samples / m[0]) for m in names if m]
    found = [f for f in found if up_to is None or f[0] <= up_to]
    if not found:
        return None, []
    step = max(s for s, _, _ in found)
    return step, sorted((i, p) for s, i, p in found if s == step)


def frame_strip(path: Path) -> Image.Image:
    """Up to MAX_FRAMES frames of a video, evenly spaced from first to last, side by side, FRAME_H high (a
    file that cannot be read: a line saying why, so that it costs its row, not the report)."""
    try:
        import av

        with av.open(str(path)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        if not frames:
            raise ValueError("no video frames")
    except Exception as e:  # whatever the file or the decoder does: its row says so
        note = Image.new("RGB", (WIDTH - 24, 20), "white")
        why = f"{path.name} could not be read: {e}"
        ImageDraw.Draw(note).text((0, 2), why, fill="firebrick", font=load_font())
        return note
    picked = np.unique(np.linspace(0, len(frames) - 1, min(MAX_FRAMES, len(frames))).round().astype(int))
    h, w = frames[0].shape[:2]
    size = (max(1, round(w * FRAME_H / h)), FRAME_H)
    count = max(1, min(len(picked), (WIDTH - 24) // (size[0] + 4)))  # as many as fit across
    picked = picked[np.linspace(0, len(picked) - 1, count).round().astype(int)]
    resample = Image.NEAREST if FRAME_H >= h else Image.BOX  # tiny previews: sharp pixels
    strip = Image.new("RGB", (count * (size[0] + 4), FRAME_H), "white")
    for n, index in enumerate(picked):
        strip.paste(Image.fromarray(frames[index]).resize(size, resample), (n * (size[0] + 4), 0))
    return strip


def preview_prompts(run_dir: Path) -> list[str]:
    """sample.prompts of the run's config.yaml (captions only: none when it cannot be read)."""
    try:
        from omegaconf import OmegaConf

        return [str(p) for p in OmegaConf.load(run_dir / "config.yaml").sample.prompts]
    except Exception:
        return []


def short(value: float) -> str:
    """4 significant digits, thousands as k and millions as M (12.5k tokens/s, not 1.25e+04)."""
    if abs(value) >= 1e6:
        return f"{value / 1e6:.4g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.4g}k"
    return f"{value:.4g}"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
