"""Parallel VAE decode/encode checks run by tests/test_parallel_vae.py under torchrun (gloo, CPU).

Every rank builds the same tiny random VAEs and latents from fixed seeds and computes the serial tiled
decode itself (group=None); the decode shared across the world group must match it on every rank.
One launch runs every case for kl, wan and identity (processes are expensive to start). Prints
`ok <check>` per passed check (rank 0); any mismatch raises, so the exit code is non-zero.
"""

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.schema import VAEConfig  # noqa: E402
from models import tiling  # noqa: E402
from models.vae import build_vae  # noqa: E402
from parallel.compute import comm  # noqa: E402
from parallel.compute import vae as parallel_vae  # noqa: E402

TOLERANCE = 1e-5  # max abs difference to the serial tiled decode (the same tiles, blended in the same order)

# (kind, latent shape (B, C, t, h, w), tile, overlap): tile counts 6 and 8 (more than ranks), 2 (fewer than
# 3 ranks: one rank decodes nothing and still joins the gather), 3 (uneven over 2), 1 (no collective)
CASES = [
    ("kl", (2, 4, 2, 10, 14), 6, 2),  # 2 x 3 = 6 tiles, batch 2
    ("kl", (1, 4, 1, 6, 10), 6, 2),  # 1 x 2 = 2 tiles
    ("kl", (1, 4, 1, 6, 14), 6, 2),  # 1 x 3 = 3 tiles
    ("kl", (1, 4, 1, 6, 6), 6, 2),  # 1 tile: every rank decodes it whole
    ("wan", (1, 4, 2, 6, 10), 4, 2),  # 2 x 4 = 8 tiles, 5 frames
    ("wan", (1, 4, 2, 4, 7), 4, 1),  # 1 x 2 = 2 tiles
    ("identity", (1, 3, 5, 8, 8), 4, 1),  # 5 frames
    ("identity", (1, 3, 2, 8, 8), 4, 1),  # 2 frames
]


def check(name, error, tolerance=TOLERANCE):
    if not error <= tolerance:
        raise AssertionError(f"{name}: max abs difference {error:.2e} > {tolerance:.0e}")
    if dist.get_rank() == 0:
        print(f"ok {name} ({error:.1e})", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.group.WORLD
    size = dist.get_world_size()
    vaes = {kind: build_vae(OmegaConf.structured(VAEConfig(kind=kind))) for kind in ("kl", "wan", "identity")}
    for kind, shape, tile, overlap in CASES:
        vae = vaes[kind]
        z = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        tiles = len(tiling.plan_tiles(vae, shape[2:], tile, overlap))
        name = f"decode {kind} {tiles} tiles P={size}"
        gathers = comm.stats()["ops"].get("all_gather", 0)
        shared = parallel_vae.decode(vae, z, world, tile=tile, overlap=overlap)
        serial = parallel_vae.decode(vae, z, None, tile=tile, overlap=overlap)
        issued = comm.stats()["ops"].get("all_gather", 0) - gathers
        if issued != (tiles > 1):  # one gather, on every rank, whenever there is more than one tile
            raise AssertionError(
                f"{name}: {issued} all-gathers on rank {dist.get_rank()}, expected {int(tiles > 1)}"
            )
        check(name, (shared - serial).abs().max().item())

    # encode: the same tiles in pixel space, shared; and a gather chunked under a tiny message cap,
    # with the control group fence
    vae = vaes["kl"]
    x = torch.rand(1, 3, 2, 40, 56, generator=torch.Generator().manual_seed(1)) * 2 - 1
    check(
        f"encode kl P={size}",
        (
            parallel_vae.encode(vae, x, world, tile=6, overlap=2)
            - parallel_vae.encode(vae, x, None, tile=6, overlap=2)
        )
        .abs()
        .max()
        .item(),
    )
    comm.configure(max_message_mb=0.01)
    z = torch.randn(1, 4, 2, 10, 14, generator=torch.Generator().manual_seed(2))
    check(
        f"decode kl chunked, fenced P={size}",
        (
            parallel_vae.decode(vae, z, world, tile=6, overlap=2, control_group=world)
            - parallel_vae.decode(vae, z, None, tile=6, overlap=2)
        )
        .abs()
        .max()
        .item(),
    )
    if dist.get_rank() == 0:
        print(f"ok all checks; comm ops {comm.stats()['ops']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_finished()  # gloo threads must not outlive the interpreter
