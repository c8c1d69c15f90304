"""The step cache side by side with the uncached sampler, on the trained demo checkpoint, in one run: per
method and threshold, the transformer calls that ran every block, the blocks run, the wall-time speedup,
PSNR against the uncached videos, and the demo judge's scores (colour, coherent, direction, shape, all).

    python scripts/bench_cache.py [--config configs/demo.yaml] [--thresholds 0.2 0.3 0.5]
        [--first-block-thresholds 0.05 0.1 0.2] [--methods calibrated first_block] [--plot F.png]
    python scripts/bench_cache.py --tiny     # seconds: a tiny random model, checks that the script runs

Any family: it samples through infer.py, and times the walks of the schedule (encoding and decoding left
out). It calibrates first (scripts/calibrate_cache.py's measurement, on sample.prompts) unless
sample.cache_calibration names a file. The judged prompts are the demo's held-out ones (eval_demo.py).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import parallel.lifecycle.startup  # noqa: E402, F401  (before torch loads)
from configs import DEFAULT_RECIPE, load_config, split_overrides  # noqa: E402
from parallel.lifecycle.entrypoint import run_as_process  # noqa: E402


def psnr(video: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of videos in [0, 1] (inf when identical)."""
    mse = float(np.mean((video.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def calibrate(cfg, args, overrides, path: Path, session) -> Path:
    """scripts/calibrate_cache.py's table of the recipe's weights on sample.prompts x 2 seeds, at `path`."""
    from calibrate_cache import record_velocities

    from models.step_cache import Calibration
    from parallel.checkpoints.checkpoint_files import find_checkpoint
    from parallel.compute.cache import calibration_subject

    checkpoint = find_checkpoint(cfg, None, args.tiny)  # what infer.py samples: the run's latest
    made = SimpleNamespace(config=args.config, seeds=2, checkpoint=None, random_weights=args.tiny, lora=[])
    made.image = made.last_image = []  # calibrate_cache.py's flags: a text-conditioned demo
    velocities = record_velocities(cfg, made, overrides, list(cfg.sample.prompts), cfg.sample.steps, session)
    subject = calibration_subject(cfg, checkpoint, cfg.sample.use_ema, args.tiny, [], cfg.sample.guidance)
    Calibration.measure(velocities, f"{args.config}, sample.prompts x 2 seeds", subject).save(path)
    return path


def compare(cfg, args, overrides, calibration, max_skips: int, session) -> list:
    """A row per method and threshold (uncached first): the held-out prompts sampled through infer.py, the
    walks timed (encoding and decoding left out), the calls that ran every block, PSNR and the judge."""
    from benchlib import infer_videos
    from eval_demo import judge, summarise

    from data.synthetic import held_out_prompts

    prompts = [prompt for prompt in held_out_prompts() for _ in range(args.seeds)][: 2 if args.tiny else None]
    steps, data = cfg.sample.steps, cfg.data
    base = ["--config", args.config, "--prompt", *prompts, "--seed", "0", "--frames", data.frames]
    base += ["--height", data.height, "--width", data.width, *(["--random-weights"] if args.tiny else [])]
    caching = [f"sample.cache_max_skips={max_skips}", f"sample.cache_calibration={calibration or 'null'}"]
    base += [*overrides, *caching]

    def run(cache: list) -> tuple:
        walked = dict(seconds=0.0, calls=0.0, samples=0, depth=0)

        def timing(denoise_with):
            def walk(family, parts, schedule, noise, *rest):
                start = time.perf_counter()
                x = denoise_with(family, parts, schedule, noise, *rest)
                walked["seconds"] += time.perf_counter() - start
                calls = steps if parts.cache is None else parts.cache.full_calls  # per sample: first_block
                walked["calls"] += calls * noise.shape[0]
                walked["samples"] += noise.shape[0]
                walked["depth"] = len(parts.transformer.blocks)
                return x

            return walk

        videos = infer_videos([*base, *cache], len(prompts), session, walk=timing)
        calls = walked["calls"] / walked["samples"]
        # blocks run: a calibrated skip runs none; a first_block reuse still runs the first block
        first_block = "sample.cache=first_block" in cache
        blocks = calls * walked["depth"] + (steps - calls) * first_block
        scores = summarise([judge(prompt, video) for prompt, video in zip(prompts, videos, strict=True)])
        return videos, dict(calls=calls, blocks=blocks, seconds=walked["seconds"], **scores)

    reference, uncached = run(["sample.cache=none"])
    none = dict(method="none", threshold=0.0, psnr=float("inf"), speedup=1.0, call_ratio=1.0, block_ratio=1.0)
    rows = [dict(none, **uncached)]
    caches = [("calibrated", t, f"sample.cache_threshold={t}") for t in args.thresholds]
    caches += [
        ("first_block", t, f"sample.cache_first_block_threshold={t}") for t in args.first_block_thresholds
    ]
    for method, threshold, key in [c for c in caches if c[0] in args.methods]:
        videos, row = run([f"sample.cache={method}", key])
        row.update(
            method=method,
            threshold=threshold,
            psnr=psnr(videos, reference),
            speedup=uncached["seconds"] / row["seconds"],
            call_ratio=uncached["calls"] / row["calls"],
            block_ratio=uncached["blocks"] / row["blocks"],
        )
        rows.append(row)
    return rows


def main(argv=None, session=None):
    args, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(Path(DEFAULT_RECIPE).with_name("demo.yaml")))
    p.add_argument(
        "--methods", nargs="+", default=["calibrated", "first_block"], choices=["calibrated", "first_block"]
    )
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5, 0.8])
    p.add_argument("--first-block-thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    p.add_argument("--max-skips", type=int, default=None, help="default: sample.cache_max_skips")
    p.add_argument("--seeds", type=int, default=4, help="samples per held-out prompt")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="a PNG of speed against PSNR")
    p.add_argument("--tiny", action="store_true", help="a tiny random model in seconds; not a figure")
    args = p.parse_args(args)
    if args.tiny:  # the test suite's tiny recipe
        tiny = Path(__file__).resolve().parents[1] / "tests" / "tiny.yaml"
        args.config, args.seeds, args.thresholds = str(tiny), 1, args.thresholds[:2]
        args.first_block_thresholds = [0.05]
        overrides = [*overrides, "sample.steps=6"]
    cfg = load_config(args.config, overrides)
    from calibrate_cache import check_one_process
    from eval_demo import CHECKS

    from models.families import family_named

    if "calibrated" in args.methods:
        check_one_process(family_named(cfg.model.family), "scripts/bench_cache.py --methods calibrated")

    steps, max_skips = cfg.sample.steps, args.max_skips or cfg.sample.cache_max_skips
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as folder:
        calibration = cfg.sample.cache_calibration
        if "calibrated" in args.methods and not calibration:
            calibration = calibrate(cfg, args, overrides, Path(folder) / "calibration.json", session)
        rows = compare(cfg, args, overrides, calibration, max_skips, session)
    print(
        f"| method | threshold | full calls of {steps} | fewer calls | fewer blocks | wall speedup "
        "| PSNR dB | " + " | ".join(CHECKS) + " | all |"
    )
    print("| --- " * (8 + len(CHECKS)) + "|")
    for r in rows:
        scores = " | ".join(f"{r[f'{k}_accuracy']:.1%}" for k in (*CHECKS, "all"))
        print(
            f"| {r['method']} | {r['threshold'] or '-'} | {r['calls']:g} | {r['call_ratio']:.2f}x | "
            f"{r['block_ratio']:.2f}x | {r['speedup']:.2f}x | {r['psnr']:.1f} | {scores} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(steps=steps, max_skips=max_skips, rows=rows), indent=1))
    if args.plot:
        plot(rows[1:], args.plot, steps, max_skips)


COLOURS = {"calibrated": "steelblue", "first_block": "darkorange"}


def plot(rows, path, steps, max_skips):
    """Fewer blocks run (x) against PSNR (y), one labelled point per threshold and a line per method, drawn
    with PIL (configs/plot.py: no matplotlib here)."""
    from PIL import Image, ImageDraw

    from configs.plot import Axes

    width, height, margin = 560, 380, 60
    finite = [r for r in rows if np.isfinite(r["psnr"])]
    xs, ys = [r["block_ratio"] for r in finite], [r["psnr"] for r in finite]
    image = Image.new("RGB", (width, height), "white")
    box = (margin, margin, width - margin, height - margin)
    axes = Axes(ImageDraw.Draw(image), box, (1.0, max(xs) * 1.1), (min(ys) - 2, max(ys) + 2))
    axes.frame()
    axes.x_ticks(range(int(axes.x0), int(axes.x1) + 1), "{}x")
    axes.y_ticks(range(int(axes.y0), int(axes.y1) + 1, 2), "{} dB")
    for line, (method, colour) in enumerate(COLOURS.items()):
        mine = [r for r in finite if r["method"] == method]
        axes.line([r["block_ratio"] for r in mine], [r["psnr"] for r in mine], colour, width=2)
        for r in mine:
            px, py = axes.at(r["block_ratio"], r["psnr"])
            axes.dot((px, py), colour)
            axes.text((px + 6, py - 14), f"{r['threshold']:g}")
        axes.text((width - 170, 40 + 14 * line), method, fill=colour)
    axes.text((margin, 15), f"step cache, demo, {steps} steps, <= {max_skips} skips in a row")
    axes.text((width // 2, height - 25), "fewer blocks run (x)", align="centre")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


if __name__ == "__main__":
    run_as_process(main)
