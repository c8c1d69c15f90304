"""Buckets and the global-plan sampler: unit tests, and property tests over random bucket
distributions, dataset sizes, dp sizes 1-16 and batch sizes."""

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs import load_config
from data.buckets import Bucket
from data.loader import build_buckets
from data.sampler import BucketSampler
from tests.conftest import TINY

WAN = ["vae.kind=wan", "model.patch_size=[1,2,2]"]  # spatial stride 8, temporal 4, causal: multiples of 16


def table(*overrides):
    return build_buckets(load_config(TINY, list(overrides)))


def test_default_recipe_is_one_bucket_of_the_data_size():
    t = table()
    assert t.buckets == [Bucket(4, 16, 16)] and t.batch_sizes == [4]  # tiny.yaml: 4 x 16 x 16, batch 4


def test_buckets_snap_to_the_vae_and_patch_and_keep_area_and_ratio():
    t = table(
        *WAN,
        "data.resolutions=[256,512]",
        'data.aspect_ratios=["16:9","1:1","9:16","4:3"]',
        "data.frame_counts=[1,9,17]",
    )
    assert len(t) == 3 * 2 * 4
    for b in t.buckets:
        assert b.height % 16 == 0 and b.width % 16 == 0
        budget = min((256**2, 512**2), key=lambda a: abs(a - b.height * b.width))
        assert abs(b.height * b.width / budget - 1) < 0.08
        assert min(abs(np.log(b.width / b.height / r)) for r in (16 / 9, 1, 9 / 16, 4 / 3)) < 0.08
    assert Bucket(9, 256, 256) in t.buckets and Bucket(1, 512, 512) in t.buckets


def test_frame_counts_must_suit_the_vae():
    with pytest.raises(
        ValueError, match=r"data.frame_counts: frames=8 cannot be represented: the VAE needs 1 \+ k\*4"
    ):
        table(*WAN, "data.frame_counts=[1,8]")
    with pytest.raises(ValueError, match="not width:height"):
        load_config(TINY, ['data.aspect_ratios=["wide"]'])


def test_assignment_nearest_ratio_longest_clip_largest_class_without_upscaling():
    t = table(
        *WAN,
        "data.resolutions=[256,512]",
        'data.aspect_ratios=["16:9","1:1"]',
        "data.frame_counts=[1,9,17,33]",
    )
    name = lambda a: t.buckets[a[0]].name if a[0] is not None else a[1]
    # 100 frames at 30 fps resampled to 15 fps hold 50 frames: the 33-frame bucket, 16:9 at the 512 class
    assert name(t.assign(1920, 1080, 100, 30, 15)) == "33x384x688"
    assert name(t.assign(1920, 1080, 40, 30, 15)) == "17x384x688"  # 20 frames at 15 fps
    assert name(t.assign(400, 380, 12)) == "9x256x256"  # 1:1; 512 would need 1.35x
    assert name(t.assign(300, 200, 1)) == "too small (would need more than 1x upscaling)"
    assert (
        name(t.assign(640, 360, 5)) == "1x192x336"
    )  # 5 frames hold only the 1-frame bucket; 512 needs 1.08x
    lenient = table(
        *WAN,
        "data.resolutions=[256]",
        'data.aspect_ratios=["16:9","1:1"]',
        "data.frame_counts=[9]",
        "data.max_upscale=1.2",
    )
    assert lenient.buckets[lenient.assign(300, 200, 9)[0]].name == "9x192x336"  # 1.12x enlargement allowed
    assert lenient.assign(300, 200, 5) == (None, "too short (fewer than 9 frames)")


def test_batch_size_from_the_token_budget_with_a_cap():
    t = table(*WAN, "data.resolutions=[256]", "data.frame_counts=[1,17]", "data.tokens_per_batch=4096")
    # 256x256 -> 32x32 latent -> 16x16 patches = 256 tokens per latent frame; 17 frames -> 5 latent frames
    assert dict(zip([b.name for b in t.buckets], t.tokens)) == {"1x256x256": 256, "17x256x256": 1280}
    assert t.batch_sizes == [16, 3]
    assert table(
        *WAN,
        "data.resolutions=[256]",
        "data.frame_counts=[1,17]",
        "data.tokens_per_batch=4096",
        "data.max_batch_size=8",
    ).batch_sizes == [8, 3]


# ---- the sampler -----------------------------------------------------------------------------------


def samplers(bucket_sizes, batch_sizes, dp, seed=0, remainder="pad"):
    bucket_of = np.repeat(np.arange(len(bucket_sizes)), bucket_sizes)
    np.random.default_rng(seed).shuffle(bucket_of)  # samples of a bucket are scattered through the dataset
    return [BucketSampler(bucket_of, batch_sizes, r, dp, seed, remainder) for r in range(dp)], bucket_of


distributions = st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda sizes: sum(sizes) > 0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=distributions,
    data=st.data(),
    dp=st.integers(1, 16),
    seed=st.integers(0, 2**16),
    remainder=st.sampled_from(["pad", "drop"]),
)
def test_every_rank_takes_the_same_steps_and_sees_each_sample_once(sizes, data, dp, seed, remainder):
    batch_sizes = data.draw(st.lists(st.integers(1, 8), min_size=len(sizes), max_size=len(sizes)))
    num_batches = sum(-(-n // b) for n, b in zip(sizes, batch_sizes))
    if remainder == "drop" and num_batches < dp:
        with pytest.raises(ValueError, match="use data.epoch_remainder=pad"):
            samplers(sizes, batch_sizes, dp, seed, remainder)
        return
    ranks, bucket_of = samplers(sizes, batch_sizes, dp, seed, remainder)
    steps = ranks[0].steps_per_epoch
    assert steps >= 1 and all(r.steps_per_epoch == steps for r in ranks)
    for epoch in range(2):
        # each rank iterates its own sampler up to the epoch boundary: no rank runs out early
        per_rank = [[r.batch_at(epoch * steps + s) for s in range(steps)] for r in ranks]
        seen = Counter()
        for batches in per_rank:
            for batch in batches:
                assert batch and all(e == epoch for _, e in batch)
                buckets = {int(bucket_of[i]) for i, _ in batch}
                assert len(buckets) == 1 and len(batch) <= batch_sizes[buckets.pop()]  # one bucket's shape
                seen.update(i for i, _ in batch)
        padding = ranks[0].padding_batches
        if remainder == "pad":
            assert set(seen) == set(range(len(bucket_of)))  # every sample trains every epoch
            assert sum(seen.values()) - len(bucket_of) <= padding * max(
                batch_sizes
            )  # repeats only as padding
            assert padding < dp
        else:
            assert max(seen.values()) == 1  # nothing repeats
            assert len(bucket_of) - len(seen) <= -padding * max(batch_sizes) and -padding < dp


@settings(max_examples=60, deadline=None)
@given(sizes=distributions, data=st.data(), dp=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_resuming_at_any_step_yields_exactly_the_remaining_batches(sizes, data, dp, seed):
    batch_sizes = data.draw(st.lists(st.integers(1, 8), min_size=len(sizes), max_size=len(sizes)))
    ranks, bucket_of = samplers(sizes, batch_sizes, dp, seed)
    horizon = 3 * ranks[0].steps_per_epoch + 2
    resume_at = data.draw(st.integers(0, horizon - 1))
    for r, sampler in enumerate(ranks):
        straight = [b for _, b in zip(range(horizon), iter(sampler))]
        state = json.loads(json.dumps(sampler.state_dict(resume_at)))  # it goes through a checkpoint
        fresh = BucketSampler(bucket_of, batch_sizes, r, dp, seed)
        fresh.start_step, why = fresh.load_state_dict(state)
        assert fresh.start_step == resume_at and why == ""
        assert [b for _, b in zip(range(horizon - resume_at), iter(fresh))] == straight[resume_at:]


def test_resume_refuses_another_dp_size_or_other_data():
    ranks, bucket_of = samplers([7, 1], [2, 2], 3)
    state = ranks[0].state_dict(5)
    assert (state["epoch"], state["step_in_epoch"], state["dp_size"]) == (
        2,
        1,
        3,
    )  # 5 batches + 1 padding = 2 steps
    with pytest.raises(ValueError, match="written with 3 data-parallel ranks and this run has 2"):
        BucketSampler(bucket_of, [2, 2], 0, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="batch plan differs"):
        BucketSampler(bucket_of[::-1].copy(), [2, 2], 0, 3).load_state_dict(state)
    with pytest.raises(ValueError, match="an epoch had 2 steps"):
        BucketSampler(np.zeros(30, dtype=int), [2, 2], 0, 3).load_state_dict(state)


@settings(max_examples=40, deadline=None)
@given(
    sizes=distributions,
    data=st.data(),
    dp=st.integers(1, 8),
    new_dp=st.integers(1, 8),
    seed=st.integers(0, 99),
)
def test_a_replanned_resume_starts_a_new_epoch_and_resumes_exactly_again(sizes, data, dp, new_dp, seed):
    """data.on_plan_change=new_epoch: another dp size continues at the checkpoint's step with the next
    epoch under the new plan, the same on every rank; a later checkpoint of that run resumes exactly."""
    batch_sizes = data.draw(st.lists(st.integers(1, 8), min_size=len(sizes), max_size=len(sizes)))
    old, bucket_of = samplers(sizes, batch_sizes, dp, seed)
    at = data.draw(st.integers(0, 3 * old[0].steps_per_epoch))
    state = json.loads(json.dumps(old[0].state_dict(at)))
    new = [BucketSampler(bucket_of, batch_sizes, r, new_dp, seed) for r in range(new_dp)]
    outcomes = [s.load_state_dict(state, on_change="new_epoch") for s in new]
    if new_dp == dp:
        assert outcomes == [(at, "")] * dp  # nothing changed: the exact position
        return
    assert all(step == at and "data-parallel ranks" in why for step, why in outcomes)
    epoch = state["epoch"] + 1
    steps = new[0].steps_per_epoch
    for r, sampler in enumerate(new):  # the next epoch from its first batch, then the one after
        assert sampler.position(at) == (epoch, 0) and sampler.position(at + steps) == (epoch + 1, 0)
        assert [i for i, _ in sampler.batch_at(at)] == sampler.plan(epoch)[r].tolist()
    later = at + data.draw(st.integers(0, 2 * steps))
    for r, sampler in enumerate(new):
        again = BucketSampler(bucket_of, batch_sizes, r, new_dp, seed)
        assert again.load_state_dict(json.loads(json.dumps(sampler.state_dict(later)))) == (later, "")
        assert again.batch_at(later + 1) == sampler.batch_at(later + 1)


def test_a_checkpoint_from_before_the_plan_continues_only_with_a_new_epoch():
    old_format = dict(
        seed=0, step=7, epoch=1, dataset_size=10, batch_size=2, dp_size=1
    )  # issue 2's sampler state
    with pytest.raises(
        ValueError, match=r"lacks \['step_in_epoch', 'plan_hash'\].*data.on_plan_change=new_epoch"
    ):
        BucketSampler(np.zeros(10, dtype=int), [2]).load_state_dict(old_format)
    sampler = BucketSampler(np.zeros(10, dtype=int), [2])
    assert sampler.load_state_dict(old_format, on_change="new_epoch")[0] == 7
    assert sampler.position(7) == (2, 0) and sampler.position(12) == (3, 0)


def test_the_skewed_example_pads_to_equal_steps():
    """7 samples in one bucket and 1 in another, batch 2, 3 ranks: 4 + 1 = 5 batches, padded to 6."""
    ranks, _ = samplers([7, 1], [2, 2], 3)
    assert ranks[0].steps_per_epoch == 2 and ranks[0].padding_batches == 1
    assert [len(r.batch_at(s)) for r in ranks for s in range(2)].count(1) >= 2  # the short batches stay short
