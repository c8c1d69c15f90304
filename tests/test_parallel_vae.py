"""Tiled and parallel VAE decode/encode (parallel/compute/vae.py).

The multi-process checks live in tests/vae_worker.py: one launch (tests/ranks.py) per process count runs
every case for kl, wan and identity, because each launch costs seconds.
"""

import pytest
import torch
from omegaconf import OmegaConf

from configs.schema import VAEConfig
from models import tiling
from models.vae import LatentSpace, build_vae
from parallel.compute import vae as parallel_vae
from tests.conftest import ranks

# Tiled vs untiled decode of the tiny random VAEs (seed 0), measured on the cases below (torch 2.13 CPU):
#   kl  (1, 4, 2, 10, 14) latent, tile 6 overlap 2, 6 tiles:  max abs 1.30, mean abs 0.094 (output std 0.38)
#   wan (1, 4, 2, 6, 10) latent, tile 4 overlap 2, 8 tiles:   max abs 0.70, mean abs 0.087 (output std 0.29)
# Far from 1e-5, and larger than with trained VAEs: each tile normalises with its own GroupNorm
# statistics, the decoders' mid-block attention sees only the tile, and zero padding replaces the
# neighbours at tile borders; random weights have learned no locality to hide any of it. The bounds
# carry about 25% headroom over the measurement, so a blending bug (a seam of zeros, a misplaced tile)
# that pushes the error to the size of the output itself fails them.
TILED_TOLERANCE = {"kl": (1.6, 0.12), "wan": (0.9, 0.11)}  # (max abs, mean abs)
TILED_CASES = {"kl": ((1, 4, 2, 10, 14), 6, 2), "wan": ((1, 4, 2, 6, 10), 4, 2)}


def tiny_vae(kind):
    return build_vae(OmegaConf.structured(VAEConfig(kind=kind)))


class PointwiseVAE(LatentSpace):
    """A stand-in causal video VAE with Wan's strides whose output pixel depends only on the latent pixel
    above it: tiling changes nothing, so tiled == untiled checks placement and blend weights alone."""

    spatial_stride, temporal_stride, causal, latent_channels = 4, 4, True, 4

    def decode(self, z):
        z = torch.cat([z[:, :, :1], z[:, :, 1:].repeat_interleave(self.temporal_stride, 2)], 2)
        return (
            torch.tanh(z[:, :3])
            .repeat_interleave(self.spatial_stride, 3)
            .repeat_interleave(self.spatial_stride, 4)
        )

    def encode(self, x):
        x = torch.cat([x[:, :, :1], x[:, :, 1 :: self.temporal_stride]], 2)[
            :, :, :, :: self.spatial_stride, :: self.spatial_stride
        ]
        return torch.cat([x, x[:, :1]], 1)


@pytest.mark.timeout(30)
def test_axis_tiles_cover_overlap_and_stay_within_the_tile():
    for tile in range(1, 13):
        for overlap in range(tile):
            for size in range(1, 60):
                spans = tiling.axis_tiles(size, tile, overlap)
                assert spans[0][0] == 0 and spans[-1][1] == size, (size, tile, overlap, spans)
                assert len({end - start for start, end in spans}) == 1  # one length: one gather slot size
                assert all(end - start <= tile for start, end in spans)
                for (s0, e0), (s1, _) in zip(spans, spans[1:]):
                    assert s0 < s1 and e0 - s1 >= overlap, (size, tile, overlap, spans)
                if size > tile:  # no more tiles than the plain stride needs
                    assert len(spans) == -(-(size - overlap) // (tile - overlap))
                else:
                    assert spans == [(0, size)]


@pytest.mark.timeout(30)
def test_deal_balances_area_and_ignores_nothing():
    assert parallel_vae.deal([4] * 12, 5) == [[0, 5, 10], [1, 6, 11], [2, 7], [3, 8], [4, 9]]
    assert parallel_vae.deal([1, 1], 3) == [[0], [1], []]  # rank 2 has no tile and still joins the gather
    assert parallel_vae.deal([9, 1, 1, 1, 5, 5], 2) == [
        [0, 1, 2],
        [3, 4, 5],
    ]  # largest first: loads 11 and 11
    assert sorted(i for rank in parallel_vae.deal(list(range(1, 30)), 4) for i in rank) == list(range(29))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "size, tile, overlap", [((40, 56), 6, 2), ((20, 20), 8, 6), ((9, 31), 5, 1), ((7, 7), 8, 2)]
)
def test_blend_weights_sum_to_one_and_fade_at_tile_edges(size, tile, overlap):
    tiles = tiling.plan_tiles(PointwiseVAE(), (3, *size), tile, overlap)
    boxes = [t.pixel for t in tiles]
    weights = list(tiling.blend_weights(boxes))
    canvas = torch.zeros(max(b[0][1] for b in boxes), size[0] * 4, size[1] * 4, dtype=torch.float64)
    for box, weight in zip(boxes, weights):
        assert weight.shape == tuple(end - start for start, end in box) and weight.min() > 0
        canvas[tuple(slice(*span) for span in box)] += weight
        # an interior tile border fades in (no hard seam): the border pixel weighs little
        if box[1][0] > 0:
            assert weight[:, 0].max() < 0.2
        if box[2][1] < size[1] * 4:
            assert weight[:, :, -1].max() < 0.2
    assert (canvas - 1).abs().max() < 1e-6, f"blend weights sum to {canvas.min():.4f}..{canvas.max():.4f}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size, tile, overlap", [((10, 14), 6, 2), ((20, 20), 8, 6), ((9, 31), 5, 0)])
def test_tiling_a_pointwise_vae_changes_nothing(size, tile, overlap):
    vae = PointwiseVAE()
    z = torch.randn(2, 4, 3, *size)
    assert len(tiling.plan_tiles(vae, z.shape[2:], tile, overlap)) > 1
    torch.testing.assert_close(
        parallel_vae.decode(vae, z, tile=tile, overlap=overlap), vae.decode(z), atol=1e-6, rtol=0
    )
    x = vae.decode(z)
    torch.testing.assert_close(
        parallel_vae.encode(vae, x, tile=tile, overlap=overlap), vae.encode(x), atol=1e-6, rtol=0
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["kl", "wan"])
def test_tiled_decode_is_close_to_untiled(kind):
    vae = tiny_vae(kind)
    shape, tile, overlap = TILED_CASES[kind]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    whole = vae.decode(z)
    tiled = parallel_vae.decode(vae, z, tile=tile, overlap=overlap)
    assert tiled.shape == whole.shape and tiled.dtype == torch.float32
    difference = (tiled - whole).abs()
    max_tolerance, mean_tolerance = TILED_TOLERANCE[kind]
    assert difference.max() <= max_tolerance and difference.mean() <= mean_tolerance, (
        f"{kind}: max abs {difference.max():.3f}, mean abs {difference.mean():.4f}"
    )
    # a latent that fits one tile is the plain decode, bit for bit (the tiny demo VAEs at 32 x 32 px)
    assert torch.equal(parallel_vae.decode(vae, z, tile=max(shape[3:]), overlap=overlap), whole)


@pytest.mark.timeout(60)
def test_tiled_encode_shapes_and_untiled_path():
    vae = tiny_vae("wan")
    x = torch.rand(1, 3, 5, 48, 80, generator=torch.Generator().manual_seed(0)) * 2 - 1
    whole = vae.encode(x)
    tiled = parallel_vae.encode(vae, x, tile=4, overlap=2)
    assert tiled.shape == whole.shape == (1, 4, 2, 6, 10)
    assert (tiled - whole).abs().mean() < 0.1  # measured 0.053 (latent std 0.25); see TILED_TOLERANCE
    assert torch.equal(parallel_vae.encode(vae, x, tile=10, overlap=2), whole)  # fits one tile: untiled
    with pytest.raises(ValueError, match="width=78 must be a multiple of 8"):
        parallel_vae.encode(vae, x[..., :78], tile=4, overlap=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "tile, overlap, match",
    [
        (0, 0, r"vae.tile_latent=0: a tile must be at least 1 latent pixel; set vae.tile_latent=32"),
        (
            8,
            8,
            r"vae.tile_overlap=8 must be at least 0 and less than vae.tile_latent=8 .*set vae.tile_overlap=2",
        ),
        (8, -1, r"vae.tile_overlap=-1 must be at least 0"),
    ],
)
def test_bad_tile_config_is_a_clear_error(tile, overlap, match):
    z = torch.randn(1, 3, 2, 8, 8)
    with pytest.raises(ValueError, match=match):
        parallel_vae.decode(tiny_vae("identity"), z, tile=tile, overlap=overlap)
    with pytest.raises(ValueError, match=match):
        parallel_vae.encode(tiny_vae("identity"), z, tile=tile, overlap=overlap)


def _passed(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [line for line in result.stdout.splitlines() if line.startswith("ok ")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("processes", [2, 3])
def test_parallel_decode_equals_serial(processes):
    passed = _passed(ranks(processes, "tests/vae_worker.py", timeout=80))
    for kind, tiles in (
        ("kl", 6),
        ("kl", 2),
        ("kl", 3),
        ("kl", 1),
        ("wan", 8),
        ("wan", 2),
        ("identity", 5),
        ("identity", 2),
    ):
        assert any(line.startswith(f"ok decode {kind} {tiles} tiles P={processes} (") for line in passed), (
            kind,
            tiles,
        )
    assert any(line.startswith(f"ok encode kl P={processes} (") for line in passed)
    assert any(line.startswith(f"ok decode kl chunked, fenced P={processes} (") for line in passed)
    assert any(line.startswith("ok all checks") for line in passed)
