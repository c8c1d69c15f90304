import pytest
from omegaconf import OmegaConf

from configs.schema import ParallelConfig
from parallel.layout import LayoutError, ParallelLayout, valid_layouts


def parallel(**kw):
    return OmegaConf.structured(ParallelConfig(**kw))


def test_dp_fills_the_world():
    layout = ParallelLayout.from_config(parallel(), world_size=4, num_heads=4)
    assert (layout.dp, layout.world_size) == (4, 4)


def test_product_mismatch_names_every_factor_and_lists_valid_layouts():
    with pytest.raises(LayoutError) as e:
        ParallelLayout.from_config(parallel(dp=2), world_size=3, num_heads=12)
    message = str(e.value)
    for part in ("dp=2", "cfg=1", "pipefusion=1", "ulysses=1", "ring=1", "3 processes"):
        assert part in message
    assert "Valid layouts for 3 processes and 12 heads: (dp=3, cfg=1, pipefusion=1, ulysses=1, ring=1)" in message


def test_unimplemented_degrees_are_refused_not_ignored():
    with pytest.raises(LayoutError, match="ulysses=2 is not implemented"):
        ParallelLayout.from_config(parallel(ulysses=2), world_size=2, num_heads=4)


def test_sampling_only_degrees_in_training():
    with pytest.raises(LayoutError, match="sampling only"):
        ParallelLayout.from_config(parallel(cfg=2), world_size=2, num_heads=4, mode="train")


def test_degrees_must_be_positive():
    with pytest.raises(LayoutError, match="at least 1"):
        ParallelLayout.from_config(parallel(ring=0), world_size=2, num_heads=4)


def test_dp_rank_is_outermost():
    layout = ParallelLayout(dp=2)
    assert [layout.dp_rank(r) for r in range(2)] == [0, 1]


def test_valid_layouts_are_listed_quickly_for_large_worlds():
    import time

    assert valid_layouts(6, 12) == [ParallelLayout(dp=6)]  # only data parallelism runs in this version
    started = time.perf_counter()
    assert valid_layouts(1024, 16) == [ParallelLayout(dp=1024)]
    assert time.perf_counter() - started < 5
