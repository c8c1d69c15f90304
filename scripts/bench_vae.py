"""VAE decode benchmark: whole, tiled on one process, and tiled shared by P processes
(parallel/compute/vae.py).

    python scripts/bench_vae.py                          # tiny Wan and KL VAEs, P = 1, 2, CPU (gloo)
    python scripts/bench_vae.py --rounds 3               # on a shared machine: best of 3 launches each
    python scripts/bench_vae.py --kinds wan --processes 1 2 4 --latent 3 32 48 --tile 20 --overlap 4
    python scripts/bench_vae.py --tiny                   # 8-wide VAEs, a 1 x 8 x 12 latent in 6 tiles

P = 1 runs in this process with --threads threads; each larger P is a torchrun launch of this script
(gloo on CPU, NCCL on GPU). Times each rank's `parallel.compute.vae.decode` (median of --repeats after a
warm-up) and prints a markdown table for BENCHMARKS.md: wall and CPU seconds per rank against the
serial tiled decode. How to read it: docs/benchmarks_history.md, "Parallel VAE decode".
"""

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import benchlib
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from configs.schema import VAEConfig  # noqa: E402
from models import tiling  # noqa: E402
from models.vae import build_vae  # noqa: E402
from parallel.compute import comm  # noqa: E402
from parallel.compute import vae as parallel_vae  # noqa: E402


def median_time(fn, repeats) -> tuple[float, float]:
    """Median wall and CPU seconds of fn() on this rank, after a warm-up. CPU seconds (all of the process's
    threads) count the work a rank does whatever else runs on the machine; wall seconds are what a user
    waits. Every rank starts together, so the slowest rank's time is the wall time."""
    barrier = comm.barrier if dist.is_initialized() else None
    timing = benchlib.measure(fn, repeats, before=barrier, after=benchlib.cuda_sync())
    return timing.median, timing.cpu_median


def measure(kind, args, device, size) -> dict:
    """This rank's figures for one VAE kind; every rank's tiled time comes back in rank_times."""
    vae = build_vae(OmegaConf.structured(VAEConfig(kind=kind, tiny_base_dim=args.base_dim))).to(device)
    z = torch.randn(1, vae.latent_channels, *args.latent, generator=torch.Generator().manual_seed(0)).to(
        device
    )
    tiles = tiling.plan_tiles(vae, z.shape[2:], args.tile, args.overlap)
    owned = parallel_vae.deal([math.prod(end - start for start, end in t.pixel) for t in tiles], size)
    figures = {}
    if size == 1:
        figures["whole"], figures["whole_cpu"] = median_time(lambda: vae.decode(z), args.repeats)
        tiled = median_time(lambda: parallel_vae.decode(vae, z, None, args.tile, args.overlap), args.repeats)
    else:
        comm.reset_stats()
        tiled = median_time(
            lambda: parallel_vae.decode(vae, z, dist.group.WORLD, args.tile, args.overlap), args.repeats
        )
        figures["sent_mb"] = comm.stats()["sent"].get("all_gather", 0) / (args.repeats + 1) / 2**20
    every = torch.tensor(tiled, dtype=torch.float64, device=device)
    if size > 1:
        mine, every = every, torch.empty(size, 2, dtype=torch.float64, device=device)
        comm.all_gather_into_tensor(every, mine, dist.group.WORLD)
    every = every.view(size, 2).tolist()
    pixels = tuple(max(t.pixel[d][1] for t in tiles) for d in range(3))
    return {
        "kind": kind,
        "processes": size,
        "latent": list(z.shape),
        "pixels": pixels,
        "tiles": len(tiles),
        "tiles_per_rank": [len(o) for o in owned] if len(tiles) > 1 else "each rank all",
        "rank_times": [w for w, _ in every],
        "rank_cpu": [c for _, c in every],
        **figures,
    }


def worker(args):
    """One process of a torchrun launch: time this rank's decodes, rank 0 writes every rank's figures."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    results = [measure(kind, args, device, dist.get_world_size()) for kind in args.kinds]
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    dist.barrier()  # a rank that tears gloo down while its peer still writes aborts now and then at exit
    dist.destroy_process_group()


def launch(args, processes, result):
    if processes == 1:  # the serial decodes need no process group: this process, with a worker's threads
        torch.set_num_threads(args.threads)
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return [measure(kind, args, device, 1) for kind in args.kinds]
    worker_args = [
        "--worker",
        "--result",
        result,
        "--kinds",
        *args.kinds,
        "--latent",
        *map(str, args.latent),
        "--tile",
        str(args.tile),
        "--overlap",
        str(args.overlap),
        "--repeats",
        str(args.repeats),
        "--base-dim",
        str(args.base_dim),
    ]
    benchlib.torchrun(processes, Path(__file__).resolve(), worker_args, threads=args.threads)
    return json.loads(Path(result).read_text())


def main(argv=None):
    parser = benchlib.parser(__doc__)
    parser.add_argument("--kinds", nargs="+", default=["wan", "kl"], choices=["wan", "kl", "identity"])
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--latent",
        nargs=3,
        type=int,
        default=[3, 32, 48],
        metavar=("T", "H", "W"),
        help="latent frames, height, width (batch 1)",
    )
    parser.add_argument(
        "--tile", type=int, default=20, help="vae.tile_latent (the default 32 is for real VAEs)"
    )
    parser.add_argument("--overlap", type=int, default=4, help="vae.tile_overlap")
    parser.add_argument("--base-dim", type=int, default=16, help="width of the tiny random VAE")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="launch every process count this many times, alternating, and keep each one's fastest "
        "launch: on a shared machine, the launch least disturbed by other work",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    tiny = dict(latent=[1, 8, 12], tile=6, overlap=2, base_dim=8, repeats=1)
    args = benchlib.parse_args(parser, argv, tiny=tiny)
    if args.worker:
        return worker(args)

    load_before = os.getloadavg()[0]  # other work on the machine skews every figure: say how much there was
    launches = {p: [] for p in args.processes}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for p in args.processes:
                launches[p].append(launch(args, p, str(Path(folder) / f"p{p}.json")))
    # per process count and VAE, the launch whose slowest rank was fastest
    runs = {
        p: [
            min((results[i] for results in launches[p]), key=lambda r: max(r["rank_times"]))
            for i in range(len(args.kinds))
        ]
        for p in args.processes
    }
    device = benchlib.machine()["device"] + ("" if torch.cuda.is_available() else ", gloo")
    print(
        f"VAE decode, {device}, {args.threads} thread(s) per process, torch {torch.__version__}; "
        f"tile {args.tile} overlap {args.overlap} (latent px); median of {args.repeats}, "
        f"best of {args.rounds} launch(es); 1-min load average {load_before:.1f} before the runs\n"
    )
    rows = []
    for i, kind in enumerate(args.kinds):
        serial = runs[1][i] if 1 in runs else None
        for p, results in runs.items():
            r = results[i]
            shape, pixels = "x".join(map(str, r["latent"])), "x".join(map(str, r["pixels"]))
            if p == 1:
                whole = [
                    f"{r['whole']:.2f}",
                    f"{r['whole'] / r['rank_times'][0]:.2f}",
                    f"{r['whole_cpu']:.2f}",
                ]
                rows.append([kind, shape, pixels, "1 (whole)", 1, 1, *whole])
                rows[-1] += [f"{r['whole_cpu'] / r['rank_cpu'][0]:.2f}", 0]
            wall, cpu = (" / ".join(f"{t:.2f}" for t in r[key]) for key in ("rank_times", "rank_cpu"))
            wall_ratio, cpu_ratio = (
                f"{max(r[key]) / serial[key][0]:.2f}" if serial else "-" for key in ("rank_times", "rank_cpu")
            )
            rows.append([kind, shape, pixels, r["tiles"], p, r["tiles_per_rank"], wall, wall_ratio, cpu])
            rows[-1] += [cpu_ratio, f"{r.get('sent_mb', 0):.1f}"]
    header = ["VAE", "latent (B, C, t, h, w)", "video (T, H, W)", "tiles", "processes", "tiles per rank"]
    header += [
        "wall s per rank",
        "vs serial tiled",
        "CPU s per rank",
        "vs serial tiled",
        "sent per rank, MiB",
    ]
    print(benchlib.table(header, rows))
    if args.json:
        benchlib.write_json(args.json, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
