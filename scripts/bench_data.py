"""Data pipeline benchmarks: decoding speed, loader memory over time, and resume start-up time.

    python scripts/bench_data.py                    # all three, figures for BENCHMARKS.md
    python scripts/bench_data.py --only resume --manifest-size 1000000
    python scripts/bench_data.py --tiny             # 8 x 32 x 32 clips from small sources, short runs

- decode: 24-frame 256 x 256 clips per second from H.264 sources, in one process and through the
  DataLoader with 1 and 2 workers, against what a training step consumes (--step-time, --batch);
- memory: resident memory of each loader worker and of the main process over --batches batches;
- resume: time to the first batch when resuming at step 0 and at step 1,000,000 (target ratio <= 1.1).
How each is measured: docs/benchmarks_history.md, "Data pipeline".
"""

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402
import numpy as np  # noqa: E402

from configs import load_config  # noqa: E402
from data.loader import build_buckets, build_dataset, build_loader, build_sampler  # noqa: E402
from data.manifest import write_manifest  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """(frames, height, width) of a training clip and of the 24 fps H.264 sources it is cut from."""

    clip: tuple = (24, 256, 256)
    source: tuple = (120, 256, 456)  # 5 s, 16:9
    hd: tuple = (96, 720, 1280)  # 4 s, 720p
    sources: int = 8


SIZES, TINY_SIZES = Sizes(), Sizes(clip=(8, 32, 32), source=(16, 36, 64), hd=(16, 72, 128), sources=2)


def recipe(sizes: Sizes) -> list[str]:
    """One bucket of the clip's size (the bucket keys of the default recipe, the demo's, are cleared)."""
    frames, height, width = sizes.clip
    return [
        f"data.frames={frames}",
        f"data.height={height}",
        f"data.width={width}",
        "data.resolutions=[]",
        "data.aspect_ratios=[]",
        "data.frame_counts=[]",
        "data.tokens_per_batch=0",
        "model.patch_size=[1,2,2]",
        "train.batch_size=4",
    ]


def make_sources(folder: Path, count: int, frames: int, height: int, width: int, fps: int = 24):
    """Smooth moving gradients with grain: compresses like camera footage, not like flat colour."""
    import av

    folder.mkdir(parents=True, exist_ok=True)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(0)
    paths = []
    for v in range(count):
        path = folder / f"src{v}_{width}x{height}.mp4"
        paths.append(path)
        if path.exists():
            continue
        with av.open(str(path), mode="w") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
            stream.options = {"crf": "23", "preset": "veryfast"}
            for k in range(frames):
                phase = k / frames * 2 * np.pi
                image = np.stack(
                    [np.sin(xs / 40 + phase + v), np.cos(ys / 30 - phase), np.sin((xs + ys) / 50 + v)], -1
                )
                image = (127 + 100 * image + rng.normal(0, 6, image.shape)).clip(0, 255).astype(np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    return paths


def manifest_for(folder: Path, paths, size: int, sizes: Sizes) -> Path:
    frames, height, width = sizes.source
    entries = [
        {
            "path": paths[i % len(paths)].name,
            "caption": f"clip {i}",
            "width": width,
            "height": height,
            "num_frames": frames,
            "fps": 24.0,
        }
        for i in range(size)
    ]
    write_manifest(folder / f"manifest_{size}.jsonl", entries)
    return folder / f"manifest_{size}.jsonl"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def clips_per_second(paths, seconds: float, clip: tuple) -> float:
    from data.media import read_clip

    rng = np.random.default_rng(0)
    read_clip(paths[0], *clip, rng=rng)  # warm the file cache and the codec
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        read_clip(paths[n % len(paths)], *clip, rng=rng)
        n += 1
    return n / (time.perf_counter() - start)


def bench_decode(folder, paths, args):
    sizes = args.sizes
    clip = " x ".join(map(str, sizes.clip))
    per_worker = clips_per_second(paths, args.seconds, sizes.clip)
    print(
        f"decode: {per_worker:.1f} clips/s in one process ({clip} from {source_name(sizes.source)})",
        flush=True,
    )
    hd_paths = make_sources(folder, max(1, sizes.sources // 2), *sizes.hd)
    hd = clips_per_second(hd_paths, args.seconds, sizes.clip)
    print(f"decode: {hd:.1f} clips/s in one process ({clip} from {source_name(sizes.hd)})", flush=True)
    cfg = load_config(None, recipe(sizes) + [f"data.manifest={manifest_for(folder, paths, 4096, sizes)}"])
    results = {"clips_per_s_one_process": per_worker, "clips_per_s_one_process_720p": hd}
    for workers in (1, 2):
        table = build_buckets(cfg)
        dataset = build_dataset(cfg, table)
        loader = iter(build_loader(dataset, build_sampler(cfg, dataset, table, 0, 1), workers))
        next(loader)  # workers started
        start, clips = time.perf_counter(), 0
        while time.perf_counter() - start < args.seconds:
            batch = next(loader)
            clips += len(batch["index"])
        rate = clips / (time.perf_counter() - start)
        results[f"loader_clips_per_s_{workers}_workers"] = rate
        print(
            f"loader, {workers} worker(s): {rate:.1f} clips/s of {tuple(batch['video'].shape[1:])} uint8, in "
            f"batches of {len(batch['index'])}",
            flush=True,
        )
        del loader
    need = args.batch / args.step_time
    results["needed_clips_per_s"] = need
    print(
        f"a step of {args.step_time} s at batch {args.batch} consumes {need:.1f} clips/s: "
        f"{need / per_worker:.1f} workers' worth of decoding at the single-process rate",
        flush=True,
    )
    return results


def bench_memory(folder, paths, args):
    manifest = manifest_for(folder, paths, args.memory_manifest_size, args.sizes)
    cfg = load_config(None, recipe(args.sizes) + [f"data.manifest={manifest}", "train.batch_size=2"])
    table = build_buckets(cfg)
    dataset = build_dataset(cfg, table)
    assert [b.name for b in table.buckets] == ["x".join(map(str, args.sizes.clip))], table.buckets
    loader = iter(build_loader(dataset, build_sampler(cfg, dataset, table, 0, 1), 2))
    next(loader)
    pids = [w.pid for w in loader._workers]  # the DataLoader's worker processes
    samples = []
    for b in range(1, args.batches + 1):
        next(loader)
        if b % max(1, args.batches // 10) == 0:
            samples.append((b, [rss_mb(p) for p in pids], rss_mb(os.getpid())))
            print(
                f"memory after {b} batches: workers {', '.join(f'{m:.0f}' for m in samples[-1][1])} MiB, "
                f"main {samples[-1][2]:.0f} MiB",
                flush=True,
            )
    first, last = samples[0], samples[-1]
    growth = [b - a for a, b in zip(first[1], last[1], strict=True)]
    print(
        f"worker RSS growth from batch {first[0]} to {last[0]}: {', '.join(f'{g:+.1f}' for g in growth)} MiB",
        flush=True,
    )
    return {"rss_samples": samples, "worker_growth_mb": growth}


def source_name(source: tuple) -> str:
    return f"{source[2]} x {source[1]} H.264"


def time_to_first_batch(cfg, step: int) -> float:
    start = time.perf_counter()
    table = build_buckets(cfg)
    dataset = build_dataset(cfg, table)
    sampler = build_sampler(cfg, dataset, table, 0, 8)  # rank 0 of 8 data-parallel ranks
    state = sampler.state_dict(step)  # what a checkpoint at this step holds
    sampler.start_step, _ = sampler.load_state_dict(state)
    next(iter(build_loader(dataset, sampler, 0)))
    return time.perf_counter() - start


def bench_resume(folder, paths, args):
    manifest = manifest_for(folder, paths, args.manifest_size, args.sizes)
    cfg = load_config(None, recipe(args.sizes) + [f"data.manifest={manifest}"])
    times = {}
    for step in (0, 1_000_000, 0, 1_000_000):
        times.setdefault(step, []).append(time_to_first_batch(cfg, step))
        print(f"resume at step {step:>9,}: first batch after {times[step][-1]:.2f} s", flush=True)
    best = {s: min(t) for s, t in times.items()}
    ratio = best[1_000_000] / best[0]
    print(
        f"{args.manifest_size:,} samples: step 1,000,000 / step 0 = {ratio:.3f} (best of 2 each)", flush=True
    )
    return {"manifest_size": args.manifest_size, "seconds": times, "ratio": ratio}


def main(argv=None):
    p = benchlib.parser(__doc__)
    p.add_argument("--only", choices=["decode", "memory", "resume"], default=None)
    p.add_argument("--folder", default=None, help="where to write the source clips (default: a temp folder)")
    p.add_argument("--seconds", type=float, default=15.0, help="duration of each throughput measurement")
    p.add_argument("--batches", type=int, default=1000, help="batches for the memory measurement")
    p.add_argument(
        "--manifest-size", type=int, default=1_000_000, help="manifest lines for the resume measurement"
    )
    p.add_argument(
        "--memory-manifest-size", type=int, default=100_000, help="manifest lines for the memory one"
    )
    p.add_argument(
        "--step-time", type=float, default=1.0, help="seconds per training step to compare against"
    )
    p.add_argument("--batch", type=int, default=8, help="clips per rank per step to compare against")
    tiny = dict(seconds=0.5, batches=10, manifest_size=1000, memory_manifest_size=100)
    args = benchlib.parse_args(p, argv, tiny=tiny)
    args.sizes = TINY_SIZES if args.tiny else SIZES
    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench_data_"))
    paths = make_sources(folder, args.sizes.sources, *args.sizes.source)
    results = {}
    for name, bench in (("decode", bench_decode), ("memory", bench_memory), ("resume", bench_resume)):
        if args.only in (None, name):
            results[name] = bench(folder, paths, args)
    if args.json:
        benchlib.write_json(args.json, {"sizes": args.sizes, **results})


if __name__ == "__main__":
    main()
