"""VAE decode (and encode) in tiles, shared across the ranks of a group.

Decoding a whole video on every rank costs each rank the full time and memory, and decoding it on one
rank while the others wait in a collective is the classic watchdog timeout (DESIGN.md: no rank does
long work alone). Here the latent is cut into pieces whose layout depends only on the shapes and the
tile config, never on the number of ranks, so 1 and P processes decode the same pieces:

- `kl` and `wan`: overlapping spatial tiles over (h, w); time is never split (Wan's VAE is causal).
  Neighbouring tiles are blended with linear ramps across their overlap, in pixel space.
- identity: one piece per frame (nothing to blend; the same share-and-gather path).

Each rank decodes its share of the pieces (dealt by area, the same deal on every rank), then one
all-gather through parallel/comm.py (recorded, chunked under the message cap) brings every piece to
every rank, and every rank blends the same pieces in the same order: the result equals the serial
tiled decode. Tiles see other GroupNorm statistics and receptive fields than the whole latent, so a
tiled decode differs from an untiled one (tests/test_parallel_vae.py measures it for the tiny VAEs).
Memory per rank: the video, plus, when shared, the one gather's buffer of every tile (padded to one
size: about the video times the tiles' overlap factor, 1.3-1.9x; 1.5 GB for Wan at 720p x 81 in
float32) and this rank's own tiles. Sharing saves time, not memory; one gather keeps the collective
count fixed (xDiT's DistVAE row sharding would save memory too; FIELD_NOTES.md).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs.schema import VAEConfig
from models.vae import IdentityVAE, LatentSpace
from parallel import comm

DEFAULT_TILE = VAEConfig.tile_latent
DEFAULT_OVERLAP = VAEConfig.tile_overlap

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # (start, end) along time, height, width


@dataclass(frozen=True)
class Tile:
    latent: Box  # the piece of the latent (t, h, w)
    pixel: Box  # the piece of the video (T, H, W) it decodes to


def check_tiling(tile: int, overlap: int) -> None:
    """A ValueError naming the key and the fix for a tile config that cannot cut a latent."""
    if tile < 1:
        raise ValueError(
            f"vae.tile_latent={tile}: a tile must be at least 1 latent pixel; set vae.tile_latent="
            f"{DEFAULT_TILE} (the default), or a value larger than the latent to decode it whole"
        )
    if not 0 <= overlap < tile:
        raise ValueError(
            f"vae.tile_overlap={overlap} must be at least 0 and less than vae.tile_latent={tile} "
            f"(neighbouring tiles must advance); set vae.tile_overlap={tile // 4}"
        )


def axis_tiles(size: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    """(start, end) of the tiles along one latent axis: the fewest tiles no longer than `tile` that overlap
    their neighbours by at least `overlap`, all of one length and spread evenly, so that no thin last
    tile decodes with little context. One tile when the axis fits."""
    check_tiling(tile, overlap)
    if size <= tile:
        return [(0, size)]
    count = math.ceil((size - overlap) / (tile - overlap))
    length = math.ceil((size + (count - 1) * overlap) / count)  # <= tile, by the choice of count
    span = size - length
    # starts round(i * span / (count - 1)), in integers so that every rank computes the same ones
    starts = [(2 * i * span + count - 1) // (2 * (count - 1)) for i in range(count)]
    return [(start, start + length) for start in starts]


def _pixel_frames(vae: LatentSpace, frames: int) -> int:
    """Video frames decoded from `frames` latent frames (the inverse of LatentSpace.latent_frames)."""
    return 1 + (frames - 1) * vae.temporal_stride if vae.causal else frames * vae.temporal_stride


def plan_tiles(
    vae: LatentSpace, latent_thw, tile: int = DEFAULT_TILE, overlap: int = DEFAULT_OVERLAP
) -> list[Tile]:
    """The pieces of a latent of (t, h, w), from the shapes and the config alone (the same on every rank,
    whatever their number). kl/wan: spatial tiles, time whole; identity: one piece per frame."""
    check_tiling(tile, overlap)
    t, h, w = latent_thw
    if isinstance(vae, IdentityVAE):
        return [Tile(((f, f + 1), (0, h), (0, w)), ((f, f + 1), (0, h), (0, w))) for f in range(t)]
    s = vae.spatial_stride
    latent_frames, video_frames = (0, t), (0, _pixel_frames(vae, t))
    return [
        Tile((latent_frames, (h0, h1), (w0, w1)), (video_frames, (h0 * s, h1 * s), (w0 * s, w1 * s)))
        for h0, h1 in axis_tiles(h, tile, overlap)
        for w0, w1 in axis_tiles(w, tile, overlap)
    ]


def _volume(box: Box) -> int:
    return math.prod(end - start for start, end in box)


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


def _axis_weights(intervals: list[tuple[int, int]]) -> dict:
    """The 1-D blend weight of each distinct interval along an axis: linear ramps across the overlaps with
    its neighbours, sampled at pixel centres, divided by their sum at every position. Two neighbours'
    ramps are complementary, so the division only matters where three tiles overlap."""
    spans = sorted(set(intervals))
    raw = {}
    for i, (start, end) in enumerate(spans):
        centre = torch.arange(start, end, dtype=torch.float64) + 0.5
        weight = torch.ones(end - start, dtype=torch.float64)
        if i > 0 and spans[i - 1][1] > start:  # ramp up across the overlap with the previous interval
            weight *= ((centre - start) / (spans[i - 1][1] - start)).clamp(max=1)
        if i + 1 < len(spans) and spans[i + 1][0] < end:  # ramp down across the overlap with the next
            weight *= ((end - centre) / (end - spans[i + 1][0])).clamp(max=1)
        raw[(start, end)] = weight
    total = torch.zeros(max(end for _, end in spans), dtype=torch.float64)
    for (start, end), weight in raw.items():
        total[start:end] += weight
    return {(start, end): weight / total[start:end] for (start, end), weight in raw.items()}


def blend_weights(boxes: list[Box]):
    """Per box, in order, the (T, H, W) float32 weight its piece is blended with (made one at a time: a
    video's worth of weights at once would be the size of the video). The boxes form a grid (every
    combination of the intervals along each axis), so the weights at every position sum to 1."""
    axes = [_axis_weights([box[d] for box in boxes]) for d in range(3)]
    for box in boxes:
        wt, wh, ww = (axes[d][box[d]] for d in range(3))
        yield (wt[:, None, None] * wh[None, :, None] * ww[None, None, :]).float()


def _index(box: Box):
    return (slice(None), slice(None), *(slice(start, end) for start, end in box))


def _run_piece(apply, source: torch.Tensor, box_in: Box, box_out: Box, channels: int) -> torch.Tensor:
    piece = apply(source[_index(box_in)].contiguous()).float()
    expected = (source.shape[0], channels, *(end - start for start, end in box_out))
    if tuple(piece.shape) != expected:  # every rank sized the gather from this arithmetic
        raise RuntimeError(
            f"the VAE turned a piece of shape {tuple(source[_index(box_in)].shape)} into "
            f"{tuple(piece.shape)}, expected {expected} from its strides in models/vae.py "
            f"(LatentSpace); tiles need a VAE whose output size follows them"
        )
    return piece


@torch.no_grad()
def _tiled(
    apply, source: torch.Tensor, boxes_in: list[Box], boxes_out: list[Box], out_shape, group, control_group
) -> torch.Tensor:
    """Apply `apply` to each input box of `source` and blend the results into `out_shape`, sharing the
    boxes across `group` (None: this process does them all)."""
    channels = out_shape[1]
    ranks = 1 if group is None else dist.get_world_size(group)
    pieces = {}
    if ranks > 1:
        owned = deal([_volume(box) for box in boxes_out], ranks)
        slots = max(len(indices) for indices in owned)  # the same on every rank: a rank may send only padding
        slot_thw = [max(box[d][1] - box[d][0] for box in boxes_out) for d in range(3)]
        send = torch.zeros(slots, source.shape[0], channels, *slot_thw, device=source.device)
        for slot, i in enumerate(owned[dist.get_rank(group)]):
            piece = _run_piece(apply, source, boxes_in[i], boxes_out[i], channels)
            send[(slot, *_index([(0, n) for n in piece.shape[2:]]))] = piece
        if control_group is not None:  # wait for the slowest rank on the long-timeout group, not in `group`
            if source.is_cuda:  # the decode is queued, not done: wait for it before saying so
                torch.cuda.current_stream(source.device).synchronize()
            comm.barrier(control_group)
        received = torch.empty(ranks * slots, *send.shape[1:], device=source.device)
        comm.all_gather_into_tensor(received, send, group)
        del send
        for rank, indices in enumerate(owned):
            for slot, i in enumerate(indices):
                pieces[i] = received[(rank * slots + slot, *_index([(0, e - s) for s, e in boxes_out[i]]))]
    out = torch.zeros(out_shape, device=source.device)
    for i, weight in enumerate(blend_weights(boxes_out)):  # in tile order on every rank: identical sums
        piece = pieces[i] if i in pieces else _run_piece(apply, source, boxes_in[i], boxes_out[i], channels)
        out[_index(boxes_out[i])] += piece * weight.to(source.device)
    return out


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
    tiles = plan_tiles(vae, z.shape[2:], tile, overlap)
    if len(tiles) == 1:  # the plain decode; with one piece, every rank decoding it beats waiting for one
        return vae.decode(z).float()
    channels = z.shape[1] if isinstance(vae, IdentityVAE) else 3
    T, H, W = (max(piece.pixel[d][1] for piece in tiles) for d in range(3))
    return _tiled(
        vae.decode,
        z,
        [piece.latent for piece in tiles],
        [piece.pixel for piece in tiles],
        (z.shape[0], channels, T, H, W),
        group,
        control_group,
    )


def encode(
    vae: LatentSpace,
    x: torch.Tensor,
    group=None,
    tile: int = DEFAULT_TILE,
    overlap: int = DEFAULT_OVERLAP,
    control_group=None,
) -> torch.Tensor:
    """Video (B, 3, T, H, W) in [-1, 1] -> latents (B, C, t, h, w), as `vae.encode`, in the tiles `decode`
    uses for that latent (cut in pixel space, blended in latent space). An input that fits one tile is
    encoded whole."""
    check_tiling(tile, overlap)
    B, C, T, H, W = x.shape
    stride = vae.spatial_stride
    if not isinstance(vae, IdentityVAE) and H <= tile * stride and W <= tile * stride:
        return vae.encode(x).float()
    latent_channels, t, h, w = vae.latent_shape(T, H, W)  # a ValueError naming a size the VAE cannot take
    tiles = plan_tiles(vae, (t, h, w), tile, overlap)
    if len(tiles) == 1:
        return vae.encode(x).float()
    channels = C if isinstance(vae, IdentityVAE) else latent_channels
    return _tiled(
        vae.encode,
        x,
        [piece.pixel for piece in tiles],
        [piece.latent for piece in tiles],
        (B, channels, t, h, w),
        group,
        control_group,
    )
