import pytest
from omegaconf import OmegaConf

from configs import ConfigError, load_config
from configs.schema import ParallelConfig
from parallel.compute.layout import LayoutError, ParallelLayout, auto_layout, valid_layouts


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
    assert (
        "3 processes, 12 heads: valid (dp, cfg, pipefusion, ulysses, ring) = (3,1,1,1,1), (1,1,1,3,1), "
        "(1,1,1,1,3)."
    ) in message


def test_sampling_layouts_are_checked_against_the_model_and_guidance():
    layout = ParallelLayout.from_config(
        parallel(cfg=2, pipefusion=2), world_size=4, num_heads=4, mode="sample", depth=4, guided=True
    )
    assert (layout.cfg, layout.pipefusion, layout.dp) == (2, 2, 1)
    with pytest.raises(LayoutError) as e:
        ParallelLayout.from_config(parallel(pipefusion=4), world_size=4, num_heads=4, mode="sample", depth=2)
    assert "pipefusion=4 stages for the model's 2 blocks" in str(e.value)
    assert "(1,1,2,1,2)" in str(e.value) and "(1,1,4,1,1)" not in str(
        e.value
    )  # valid ones listed, 4 stages not
    with pytest.raises(LayoutError, match="guidance is 1"):
        ParallelLayout.from_config(
            parallel(cfg=2), world_size=2, num_heads=4, mode="sample", depth=2, guided=False
        )


def test_pipefusion_patches_are_checked_against_the_latent():
    layout = ParallelLayout(pipefusion=2)
    assert layout.check_patches(parallel(pipefusion=2), (3, 5, 3)) == 2  # default: one patch per stage
    assert layout.check_patches(parallel(pipefusion=2, pipefusion_patches=15), (3, 5, 3)) == 15
    with pytest.raises(LayoutError, match="fewer than the pipefusion=2 stages"):
        layout.check_patches(parallel(pipefusion=2, pipefusion_patches=1), (3, 5, 3))
    with pytest.raises(LayoutError, match="only 15 rows of patches"):
        layout.check_patches(parallel(pipefusion=2, pipefusion_patches=16), (3, 5, 3))
    with pytest.raises(
        LayoutError, match="pipefusion=4 needs at least 4 patches, but the latent has only 2 rows"
    ):
        ParallelLayout(pipefusion=4).check_patches(parallel(pipefusion=4), (1, 2, 4))
    with pytest.raises(ConfigError, match="'parallel.pipefusion_warmup' must be 0 or more, got -1"):
        load_config(overrides=["parallel.pipefusion_warmup=-1"])


def test_auto_sampling_layout_cfg_first_then_ulysses_then_ring_or_pipefusion_across_slow_links():
    pick = ParallelLayout.from_config
    auto = parallel(auto=True)
    assert pick(auto, 8, 12, "sample", 8, depth=30) == ParallelLayout(cfg=2, ulysses=4)
    assert pick(auto, 8, 12, "sample", 8, depth=30, guided=False) == ParallelLayout(ulysses=4, ring=2)
    assert pick(auto, 16, 12, "sample", 8, depth=30) == ParallelLayout(cfg=2, ulysses=4, ring=2)
    # PCIe inside the node: no ulysses; pipefusion and ring share what cfg leaves
    assert pick(auto, 8, 40, "sample", 8, depth=40, slow_links=True) == ParallelLayout(
        cfg=2, pipefusion=2, ring=2
    )
    assert pick(auto, 8, 40, "sample", 8, depth=40, guided=False, slow_links=True) == ParallelLayout(
        pipefusion=2, ring=4
    )
    # ... for an image; a long video's attention hides ring's transfers even on PCIe
    assert pick(auto, 8, 40, "sample", 8, depth=40, slow_links=True, tokens=75_600) == ParallelLayout(
        cfg=2, ring=4
    )
    # 4 nodes of 8, no guidance: ulysses 4 and ring 2 inside each node, pipefusion 4 across the nodes
    assert pick(auto, 32, 12, "sample", 8, depth=30, guided=False) == ParallelLayout(
        pipefusion=4, ulysses=4, ring=2
    )
    assert pick(auto, 32, 12, "sample", 8, depth=2, guided=False) == ParallelLayout(
        pipefusion=2, ulysses=4, ring=4
    )
    assert pick(auto, 8, 16, "train", 8) == ParallelLayout(ulysses=8)  # training: never cfg or pipefusion


def test_heads_must_divide_by_ulysses():
    with pytest.raises(LayoutError) as e:
        ParallelLayout.from_config(parallel(ulysses=3), world_size=3, num_heads=4)
    assert "4 attention heads do not divide by ulysses=3" in str(e.value)
    assert "(3,1,1,1,1), (1,1,1,1,3)." in str(e.value)  # ring takes any degree: the tokens are padded


def test_sequence_parallel_layouts_are_accepted():
    layout = ParallelLayout.from_config(parallel(ulysses=2, ring=2), world_size=8, num_heads=4)
    assert (layout.dp, layout.ulysses, layout.ring, layout.sequence_parallel) == (2, 2, 2, 4)


def test_one_rank_generator_ulysses_innermost_dp_outermost():
    layout = ParallelLayout(dp=2, ulysses=2, ring=2)
    assert layout.groups("ulysses") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("ring") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("ulysses", "ring") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for axes in (("dp",), ("ring",), ("ulysses",), ("ulysses", "ring")):  # every axis partitions the ranks
        assert sorted(r for g in layout.groups(*axes) for r in g) == list(range(8))
    with pytest.raises(ValueError, match="unknown parallel axes"):
        layout.groups("tensor")


def test_auto_prefers_ulysses_inside_a_node_then_ring():
    pick = ParallelLayout.from_config
    assert pick(parallel(auto=True), 8, 16, local_world_size=4) == ParallelLayout(ulysses=4, ring=2)
    assert pick(parallel(auto=True), 8, 16, local_world_size=8) == ParallelLayout(ulysses=8)
    assert pick(parallel(auto=True), 3, 4) == ParallelLayout(ring=3)  # 4 heads do not divide by 3
    # 2 nodes x 6: ulysses=4 would put ranks 4-7 on both nodes; 2 keeps every group inside one
    assert pick(parallel(auto=True), 12, 16, local_world_size=6) == ParallelLayout(ulysses=2, ring=6)
    assert pick(parallel(auto=True, dp=2), 8, 6, local_world_size=8) == ParallelLayout(
        dp=2, ulysses=2, ring=2
    )
    with pytest.raises(LayoutError, match="dp must divide"):
        pick(parallel(auto=True, dp=3), 8, 16)
    with pytest.raises(
        LayoutError, match="but parallel.cfg=2 parallel.ring=2 is set: add parallel.auto=false"
    ):
        pick(parallel(auto=True, cfg=2, ring=2), 8, 16, "sample")


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

    assert set(valid_layouts(6, 4)) == {
        ParallelLayout(dp=6),
        ParallelLayout(dp=3, ring=2),
        ParallelLayout(dp=3, ulysses=2),
        ParallelLayout(dp=2, ring=3),
        ParallelLayout(ring=6),
        ParallelLayout(ulysses=2, ring=3),
    }
    started = time.perf_counter()
    layouts = valid_layouts(1024, 16)
    assert ParallelLayout(dp=64, ulysses=16) in layouts and ParallelLayout(dp=1024) in layouts
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(
    "size, world, expected",
    [
        ("Wan2.1-1.3B", 8, (4, 2)),  # 12 heads: ulysses 4 (divides 12 and the node), ring 2
        ("Wan2.1-14B", 8, (8, 1)),  # 40 heads: ulysses 8 of {2, 4, 5, 8}
        ("Wan2.1-14B", 64, (8, 8)),  # ulysses never leaves the 8-GPU node
        ("Wan2.2-5B", 16, (8, 2)),  # 24 heads
    ],
)
def test_auto_layout_for_wan_head_counts(size, world, expected):
    from models.dit.transformer import DiT_models

    heads = DiT_models[size]["num_heads"]
    layout = auto_layout(world, heads, local_world_size=8)
    assert (layout.ulysses, layout.ring) == expected
    assert heads % layout.ulysses == 0 and layout.ulysses * layout.ring == world


def test_auto_chooses_among_the_layouts_the_model_runs_under():
    """parallel.auto for a model that splits under ulysses or ring but not both and takes no PipeFusion
    (Qwen-Image's joint attention, a family's patch pipeline): the latency model's layout where the model
    runs under it; else the next it runs under, one sample's work spread widest, ulysses inside a node;
    the processes as replicas where it runs under none but dp."""
    one = lambda o: not (o.ulysses > 1 and o.ring > 1) and o.pipefusion == 1  # noqa: E731
    sample = dict(mode="sample", depth=20)
    assert auto_layout(8, 4, 8, **sample) == ParallelLayout(cfg=2, ulysses=4)  # it runs under the choice
    assert auto_layout(8, 4, 8, **sample, takes=one) == ParallelLayout(cfg=2, ulysses=4)
    assert auto_layout(16, 4, 8, **sample) == ParallelLayout(cfg=2, ulysses=4, ring=2)
    assert auto_layout(16, 4, 8, **sample, takes=one) == ParallelLayout(cfg=2, ring=8)
    assert auto_layout(8, 16, 4) == ParallelLayout(ulysses=4, ring=2)  # training
    assert auto_layout(8, 16, 4, takes=one) == ParallelLayout(ring=8)  # never ulysses 8 across two nodes
    only_cfg = lambda o: o.ulysses == o.ring == o.pipefusion == 1  # noqa: E731
    assert auto_layout(4, 4, 4, **sample, takes=only_cfg) == ParallelLayout(dp=2, cfg=2)
    assert auto_layout(4, 4, 4, **sample, takes=lambda o: False) == ParallelLayout(dp=4)
