"""VAE decode (and encode) in tiles, shared across the ranks of a group.

The pieces come from the shapes and the tile config alone (models/tiling.py), never from the number
of ranks: each rank decodes its share (dealt by area), one all-gather brings every piece to every
rank, and every rank blends the same pieces in the same order, so the result equals the one-process
tiled decode. No rank decodes a whole video while the others wait in a collective.
"""

import torch
import torch.distributed as dist

from models import tiling
from models.tiling import DEFAULT_OVERLAP, DEFAULT_TILE, TiledPlan, index, volume
from models.vae import LatentSpace
from parallel.compute import comm


def deal(areas: list[int], ranks: int) -> list[list[int]]:
    """Piece indices per rank, balanced by area (decode cost is about proportional to it): largest first,
    each to the least loaded rank, ties to the lower rank. Computed from the areas alone, so every rank
    arrives at the same deal."""
    load, owned = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owned[rank].append(i)
        load[rank] += areas[i]
    return [sorted(indices) for indices in owned]


@torch.no_grad()
def _shared(plan: TiledPlan, source: torch.Tensor, group, control_group) -> torch.Tensor:
    """`plan` run with its pieces dealt across `group` (None or one rank: this process does them all)."""
    ranks = 1 if group is None else dist.get_world_size(group)
    if ranks == 1:
        return plan.blend(source)
    boxes_out, channels = plan.boxes_out, plan.out_shape[1]
    owned = deal([volume(box) for box in boxes_out], ranks)
    slots = max(len(indices) for indices in owned)  # the same on every rank: a rank may send only padding
    slot_thw = [max(box[d][1] - box[d][0] for box in boxes_out) for d in range(3)]
    send = torch.zeros(slots, source.shape[0], channels, *slot_thw, device=source.device)
    for slot, i in enumerate(owned[dist.get_rank(group)]):
        piece = plan.piece(source, i)
        send[(slot, *index([(0, n) for n in piece.shape[2:]]))] = piece
    if control_group is not None:  # wait for the slowest rank on the long-timeout group, not in `group`
        if source.is_cuda:  # the decode is queued, not done: wait for it before saying so
            torch.cuda.current_stream(source.device).synchronize()
        comm.barrier(control_group)
    received = torch.empty(ranks * slots, *send.shape[1:], device=source.device)
    comm.all_gather_into_tensor(received, send, group)
    del send
    pieces = {}
    for rank, indices in enumerate(owned):
        for slot, i in enumerate(indices):
            pieces[i] = received[(rank * slots + slot, *index([(0, e - s) for s, e in boxes_out[i]]))]
    return plan.blend(source, pieces)


def decode(
    vae: LatentSpace,
    z: torch.Tensor,
    group=None,
    tile: int = DEFAULT_TILE,
    overlap: int = DEFAULT_OVERLAP,
    control_group=None,
) -> torch.Tensor:
    """Latents (B, C, t, h, w) -> video (B, 3, T, H, W) float32 in [-1, 1], as `vae.decode`, on every rank
    of `group` (None: this process alone decodes every tile). `z` must be the same on every rank.
    `control_group` (optional, e.g. the runtime's gloo control group): ranks that finish their tiles
    early wait there, under its long timeout, instead of inside `group`'s all-gather."""
    plan = tiling.decode_plan(vae, z, tile, overlap)
    if plan is None:  # the plain decode; with one piece, every rank decoding it beats waiting for one
        return vae.decode(z).float()
    return _shared(plan, z, group, control_group)


def encode(
    vae: LatentSpace,
    x: torch.Tensor,
    group=None,
    tile: int = DEFAULT_TILE,
    overlap: int = DEFAULT_OVERLAP,
    control_group=None,
) -> torch.Tensor:
    """Video (B, 3, T, H, W) in [-1, 1] -> latents (B, C, t, h, w), as `vae.encode`, in the tiles `decode`
    uses for that latent. An input that fits one tile is encoded whole."""
    plan = tiling.encode_plan(vae, x, tile, overlap)
    if plan is None:
        return vae.encode(x).float()
    return _shared(plan, x, group, control_group)
