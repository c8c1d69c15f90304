"""VAE decode and encode in overlapping spatial tiles, on one device: the pieces depend only on the
shapes and the tile config, and neighbouring pieces are blended with linear ramps across their
overlap. parallel/compute/vae.py deals the same pieces across ranks; the blend here then gives the same video.
"""

import math
from dataclasses import dataclass

import torch

from models.vae import DEFAULT_OVERLAP, DEFAULT_TILE, IdentityVAE, LatentSpace

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


def pixel_frames(vae: LatentSpace, frames: int) -> int:
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
    latent_frames, video_frames = (0, t), (0, pixel_frames(vae, t))
    return [
        Tile((latent_frames, (h0, h1), (w0, w1)), (video_frames, (h0 * s, h1 * s), (w0 * s, w1 * s)))
        for h0, h1 in axis_tiles(h, tile, overlap)
        for w0, w1 in axis_tiles(w, tile, overlap)
    ]


def volume(box: Box) -> int:
    return math.prod(end - start for start, end in box)


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


def index(box: Box):
    return (slice(None), slice(None), *(slice(start, end) for start, end in box))


def run_piece(apply, source: torch.Tensor, box_in: Box, box_out: Box, channels: int) -> torch.Tensor:
    piece = apply(source[index(box_in)].contiguous()).float()
    expected = (source.shape[0], channels, *(end - start for start, end in box_out))
    if tuple(piece.shape) != expected:  # every rank sized the gather from this arithmetic
        raise RuntimeError(
            f"the VAE turned a piece of shape {tuple(source[index(box_in)].shape)} into "
            f"{tuple(piece.shape)}, expected {expected} from its strides in models/vae.py "
            f"(LatentSpace); tiles need a VAE whose output size follows them"
        )
    return piece


@dataclass
class TiledPlan:
    """How to run `apply` (a VAE's decode or encode) piece by piece: input boxes, output boxes, and the
    shape of the blended output."""

    apply: object
    boxes_in: list
    boxes_out: list
    out_shape: tuple

    def piece(self, source: torch.Tensor, i: int) -> torch.Tensor:
        return run_piece(self.apply, source, self.boxes_in[i], self.boxes_out[i], self.out_shape[1])

    @torch.no_grad()
    def blend(self, source: torch.Tensor, pieces: dict | None = None) -> torch.Tensor:
        """Every piece blended into the output, in piece order (identical sums wherever it runs); pieces
        given in `pieces` (index -> tensor, e.g. gathered from other ranks) are not computed again."""
        pieces = pieces or {}
        out = torch.zeros(self.out_shape, device=source.device)
        for i, weight in enumerate(blend_weights(self.boxes_out)):
            piece = pieces[i] if i in pieces else self.piece(source, i)
            out[index(self.boxes_out[i])] += piece * weight.to(source.device)
        return out


def decode_plan(vae: LatentSpace, z: torch.Tensor, tile: int, overlap: int) -> TiledPlan | None:
    """The tiled decode of latents `z` (B, C, t, h, w); None when one piece covers it (decode it whole)."""
    tiles = plan_tiles(vae, z.shape[2:], tile, overlap)
    if len(tiles) == 1:
        return None
    channels = z.shape[1] if isinstance(vae, IdentityVAE) else 3
    T, H, W = (max(piece.pixel[d][1] for piece in tiles) for d in range(3))
    return TiledPlan(
        vae.decode,
        [piece.latent for piece in tiles],
        [piece.pixel for piece in tiles],
        (z.shape[0], channels, T, H, W),
    )


def encode_plan(vae: LatentSpace, x: torch.Tensor, tile: int, overlap: int) -> TiledPlan | None:
    """The tiled encode of video `x` (B, 3, T, H, W), in the tiles `decode_plan` uses for its latent (cut
    in pixel space, blended in latent space); None when it fits one tile (encode it whole)."""
    check_tiling(tile, overlap)
    B, C, T, H, W = x.shape
    stride = vae.spatial_stride
    if not isinstance(vae, IdentityVAE) and H <= tile * stride and W <= tile * stride:
        return None
    latent_channels, t, h, w = vae.latent_shape(T, H, W)  # a ValueError naming a size the VAE cannot take
    tiles = plan_tiles(vae, (t, h, w), tile, overlap)
    if len(tiles) == 1:
        return None
    channels = C if isinstance(vae, IdentityVAE) else latent_channels
    return TiledPlan(
        vae.encode,
        [piece.pixel for piece in tiles],
        [piece.latent for piece in tiles],
        (B, channels, t, h, w),
    )


@torch.no_grad()
def decode(vae: LatentSpace, z: torch.Tensor, tile: int = DEFAULT_TILE, overlap: int = DEFAULT_OVERLAP):
    """Latents (B, C, t, h, w) -> video (B, 3, T, H, W) float32 in [-1, 1], tile by tile on this device."""
    plan = decode_plan(vae, z, tile, overlap)
    return vae.decode(z).float() if plan is None else plan.blend(z)


@torch.no_grad()
def encode(vae: LatentSpace, x: torch.Tensor, tile: int = DEFAULT_TILE, overlap: int = DEFAULT_OVERLAP):
    """Video (B, 3, T, H, W) in [-1, 1] -> latents (B, C, t, h, w), tile by tile on this device."""
    plan = encode_plan(vae, x, tile, overlap)
    return vae.encode(x).float() if plan is None else plan.blend(x)
