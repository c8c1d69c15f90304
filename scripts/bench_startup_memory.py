"""Peak host memory per rank while the DiT and its EMA are built and sharded (issue 11).

    python scripts/bench_startup_memory.py [--size DiT-XL] [--nproc 2] [--path both|whole|meta] [--json FILE]
    python scripts/bench_startup_memory.py --size DiT-XL --nproc 4 --task i2v   # Wan2.1 I2V's layout
    python scripts/bench_startup_memory.py --tiny    # DiT-tiny on 2 ranks: seconds

Each path runs in fresh processes (torchrun-like spawn, gloo, CPU) so that ru_maxrss measures it alone:
- whole: the start-up before issue 11, every rank builds the whole model with its weights, then
  shards it with FSDP2; the EMA likewise, after;
- meta: today's train.py: built on the meta device, sharded, then parallel/build/init.py fills each rank's
  shard one parameter at a time.
Prints a table: per path, the peak resident set size per rank (GiB); and the model's float32 size.
"""

import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def dit_kwargs(size: str, task: str) -> dict:
    """The DiT's arguments: text-to-video's 16 channels, or Wan2.1 I2V's layout (36 in, 16 out, CLIP
    features 1280 wide, 257 tokens, image keys and values in every block)."""
    from models.dit.transformer import DiT_models

    kwargs = dict(in_channels=16, text_dim=4096, patch_size=(1, 2, 2), **DiT_models[size])
    if task == "i2v":
        kwargs.update(in_channels=36, out_channels=16, image_dim=1280, image_tokens=257)
    return kwargs


def worker(rank, world, port, size, path, results, task="t2v"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from models.dit.transformer import DiT
    from parallel.build.init import materialize
    from parallel.compute.fsdp import parallelize_dit

    mesh = init_device_mesh("cpu", (world,))
    kwargs = dit_kwargs(size, task)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    models = []
    for _ in ("model", "ema"):
        if path == "whole":
            model = DiT(**kwargs)
            model.init_weights(seed=0)
            models.append(parallelize_dit(model, mesh))
            del model
        else:
            with torch.device("meta"):
                model = DiT(**kwargs)
            model = parallelize_dit(model, mesh)
            materialize(model, "cpu", seed=0)
            models.append(model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    results[rank] = (baseline / 2**20, peak / 2**20)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = benchlib.parser(__doc__)
    p.add_argument("--size", default="DiT-XL")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--path", default="both", choices=["both", "whole", "meta"])
    p.add_argument("--task", default="t2v", choices=["t2v", "i2v"], help="i2v: Wan2.1 I2V's layout")
    args = benchlib.parse_args(p, argv, tiny=dict(size="DiT-tiny", task="i2v"))
    from models.dit.transformer import DiT
    from models.layers import count_parameters

    with torch.device("meta"):
        model = DiT(**dit_kwargs(args.size, args.task))
    params = count_parameters(model)
    largest = max(p.numel() for p in model.parameters())
    print(
        f"{args.size} ({args.task}): {params / 1e9:.2f}B parameters, {params * 4 / 2**30:.1f} GiB in "
        f"float32, the largest parameter {largest * 4 / 2**20:.0f} MiB; {args.nproc} ranks; model + EMA",
        flush=True,
    )
    peaks = {}
    for path in ["whole", "meta"] if args.path == "both" else [args.path]:
        results = mp.Manager().dict()
        mp.start_processes(
            worker,
            args=(args.nproc, benchlib.free_port(), args.size, path, results, args.task),
            nprocs=args.nproc,
            start_method="spawn",
        )
        peaks[path] = {
            "after_imports_gib": results[0][0],
            "peak_gib": [results[r][1] for r in range(args.nproc)],
        }
        print(f"{path}: done", flush=True)
    rows = [
        [path, ", ".join(f"{p:.2f}" for p in r["peak_gib"]), f"{r['after_imports_gib']:.2f}"]
        for path, r in peaks.items()
    ]
    print(benchlib.table(["path", "peak resident memory per rank, GiB", "after imports (rank 0), GiB"], rows))
    if args.json:
        benchlib.write_json(
            args.json,
            {"size": args.size, "task": args.task, "parameters": params, "nproc": args.nproc, **peaks},
        )


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
