"""PipeFusion and CFG-parallel sampling: the pieces on one process, every layout in several processes
(tests/ranks.py) against the serial sampler (tests/pipefusion_worker.py), infer.py end to end, and ranks
whose messages disagree."""

import time

import numpy as np
import pytest
import torch

from models.dit.transformer import DiT
from parallel.compute.pipefusion import from_strips, to_strips
from parallel.compute.pipefusion_plan import (
    DroppedBlock,
    Item,
    MessagePlan,
    PipeFusionError,
    check_plans,
    keep_blocks,
    message_plan,
    patch_ranges,
    schedule,
    stage_blocks,
)
from tests.conftest import TINY, ranks


def test_stages_are_contiguous_and_balanced():
    assert stage_blocks(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    for depth, stages in ((30, 8), (40, 3), (5, 2)):
        ranges = stage_blocks(depth, stages)
        assert [i for r in ranges for i in r] == list(range(depth))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_patches_are_whole_rows_in_token_order():
    # 3 frames x 5 rows x 3 tokens: 15 rows cut into 4 patches of 3, 4, 4 and 4 rows
    assert patch_ranges((3, 5, 3), 4) == [(0, 9), (9, 21), (21, 33), (33, 45)]
    assert patch_ranges((1, 4, 8), 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]  # an image
    with pytest.raises(ValueError, match="at most 15 patches"):
        patch_ranges((3, 5, 3), 16)


def test_keep_blocks_holds_only_its_blocks_under_their_own_names():
    with torch.device("meta"):
        model = DiT(in_channels=4, text_dim=8, depth=5, hidden_size=32, num_heads=2)
    names = {n for n, _ in model.named_parameters()}
    stages = [keep_blocks(model, s, 2) for s in range(2)]
    parts = [{n for n, _ in stage.named_parameters()} for stage in stages]
    assert not parts[0] & {n for n in parts[1] if n.startswith("blocks.")}
    assert {
        n for n in parts[0] | parts[1]
    } == names  # every weight on some stage, under the whole model's name
    assert any(n.startswith("blocks.2.") for n in parts[0]) and any(
        n.startswith("blocks.3.") for n in parts[1]
    )
    assert len(model.blocks) == 5 and not isinstance(
        model.blocks[4], DroppedBlock
    )  # the original is untouched
    with pytest.raises(RuntimeError, match="block 4 lives on PipeFusion stage 1"):
        stages[0].blocks[4]()


@pytest.mark.parametrize("patch", [(1, 2, 2), (2, 1, 2)])
def test_a_patch_of_token_rows_is_a_slice_of_the_latent_strips(patch):
    """PipeFusion holds the latent as strips: a patch of whole token rows, unpatchified on its own, is a
    slice of them, whatever the frames and the temporal patch; from_strips undoes to_strips."""
    with torch.device("cpu"):
        model = DiT(in_channels=3, text_dim=8, depth=1, hidden_size=16, num_heads=2, patch_size=patch)
    grid, w = (3, 3, 2), 2
    tokens = torch.randn(2, 18, 3 * patch[0] * patch[1] * patch[2])
    latent = model.unpatchify(tokens, grid)
    strips = to_strips(latent, grid[0])
    assert torch.equal(from_strips(strips, grid[0]), latent)
    rows = strips.shape[3] // (grid[0] * grid[1])
    for a, b in [(0, 4), (4, 10), (10, 18)]:  # across token frames
        patch_latent = model.unpatchify(tokens[:, a:b], (1, (b - a) // w, w))
        assert torch.equal(patch_latent, strips[:, :, :, a // w * rows : b // w * rows])


def test_message_plans_match_between_neighbours_and_a_disagreement_is_named():
    items = schedule(steps=5, warmup=2, patches=[(0, 4), (4, 8), (8, 12)], tokens=12)
    assert items[:3] == [Item(0, 0, 12), Item(1, 0, 12), Item(2, 0, 4)] and len(items) == 2 + 3 * 3
    plans = [message_plan(items, s, 3, 5, 2, 3, 12) for s in range(3)]
    check_plans(plans, [4, 5, 6])  # agree
    assert plans[0].forward_sends == plans[1].forward_recvs == 11
    assert plans[2].return_sends == plans[0].return_recvs == 11 - 3  # not the final step's patches
    other = message_plan(schedule(6, 2, [(0, 4), (4, 8), (8, 12)], 12), 1, 3, 6, 2, 3, 12)
    with pytest.raises(PipeFusionError) as e:
        check_plans([plans[0], other, plans[2]], [4, 5, 6])
    message = str(e.value)
    assert "rank 4 (stage 0) plans 11 messages to rank 5, which plans to receive 14" in message
    assert "rank 5: steps=6" in message and "rank 4: steps=5" in message
    assert MessagePlan.from_tensor(plans[1].as_tensor()) == plans[1]
    # the step cache: a skipped step has no pass; a stage that would skip other steps is named
    cached = schedule(5, 2, [(0, 4), (4, 8), (8, 12)], 12, computed=[0, 3, 4])
    assert (
        cached[:2] == [Item(0, 0, 12), Item(3, 0, 12)] and [i.step for i in cached[2:]] == [4] * 3
    )  # warm-up: 2 run
    mine = [message_plan(cached, s, 3, 5, 2, 3, 12) for s in range(3)]
    check_plans(mine, [4, 5, 6])
    theirs = message_plan(
        schedule(5, 2, [(0, 4), (4, 8), (8, 12)], 12, computed=[0, 2, 4]), 2, 3, 5, 2, 3, 12
    )
    assert theirs.return_sends == mine[0].return_recvs  # the same message counts, other steps
    with pytest.raises(PipeFusionError, match="computed steps="):
        check_plans([*mine[:2], theirs], [4, 5, 6])


@pytest.mark.slow  # every layout: the whole suite's (the fast tier keeps one layout a family)
@pytest.mark.timeout(150)
def test_every_sampling_layout_against_the_serial_sampler():
    """pipefusion 2 and 4 with M = N and 2N, pipefusion x ulysses / ring / cfg, cfg alone (with dp and with
    ulysses): the serial result within 1e-5 with warm-up over every step, also on a schedule the family
    hands that is not its flow's own; with warm-up 0-2 the result of an independent one-process stale-K/V
    reference, whatever the stages and what runs inside them."""
    result = ranks(4, "tests/pipefusion_worker.py", timeout=130)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    passed = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    for case in (
        "pf4 M=4",
        "pf4 M=8",
        "pf2 M=2",
        "pf2 M=4",
        "pf2xu2",
        "pf2xr2",
        "pf2xcfg2",
        "cfg2",
        "cfg2xu2",
    ):
        assert any(line.startswith(f"ok {case} warmup=all vs serial") for line in passed), case
    for case in ("pf4", "pf2xu2", "pf2xr2", "pf2xcfg2"):
        assert any(line.startswith(f"ok {case} M=4 warmup=1 vs pf2 M=4 warmup=1") for line in passed), case
    assert sum("vs the stale-K/V reference" in line for line in passed) == 3
    for case in ("cached pf2xcfg2 warmup=all vs cached serial", "cached pf2xu2 M=4 warmup=1 vs the cached"):
        assert any(line.startswith(f"ok {case}") for line in passed), case  # sample.cache=calibrated
    for case in ("pf2xcfg2", "pf2xu2", "cfg2xu2"):  # image-to-video
        assert any(line.startswith(f"ok i2v {case} warmup=all vs i2v serial") for line in passed), case
    assert any(line.startswith("ok own schedule pf2xu2 warmup=all vs own schedule serial") for line in passed)
    stale = next(line for line in passed if line.startswith("ok pf2 M=4 warmup=1 vs serial"))
    assert 1e-4 < float(stale.rpartition("=")[2]) < 0.1, stale  # stale K/V: close to serial, not equal


SAMPLE = [
    "--config",
    str(TINY),
    "--random-weights",
    "--steps",
    "3",
    "--frames",
    "3",
    "--height",
    "20",
    "--width",
    "12",
    "--prompt",
    "a red square moving left",
    "a green circle moving up",
]


@pytest.fixture(scope="module")
def serial_videos(tmp_path_factory):
    import infer
    from tests.conftest import run_main

    folder = tmp_path_factory.mktemp("serial")
    assert run_main(infer, SAMPLE + [f"run.output_dir={folder}", "--output", str(folder / "x.npy")]) == 0
    return [np.load(folder / f"x_{i:03d}.npy") for i in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "nproc,layout",
    [
        (4, ["parallel.pipefusion=2", "parallel.cfg=2", "parallel.pipefusion_warmup=3"]),
        (2, ["parallel.pipefusion=2", "parallel.pipefusion_patches=4", "parallel.pipefusion_warmup=3"]),
    ],
)
def test_infer_under_pipefusion_equals_one_process(tmp_path, serial_videos, nproc, layout):
    result = ranks(
        nproc,
        "infer.py",
        *SAMPLE,
        f"run.output_dir={tmp_path}",
        "--output",
        str(tmp_path / "x.npy"),
        *layout,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "PipeFusion: " in result.stdout and "pipefusion=2" in result.stdout
    for i, expected in enumerate(serial_videos):
        assert np.abs(np.load(tmp_path / f"x_{i:03d}.npy") - expected).max() <= 1e-5
    assert result.stdout.count("[tessera] wrote") == 2  # one writer


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "fault,message",
    [
        (
            "pipefusion_count@1",
            "PipeFusion message plans disagree: rank 0 (stage 0) plans 5 messages to rank 1, "
            "which plans to receive 7",
        ),
        (
            "pipefusion_extra_send@1",
            "PipeFusion messages at the end of sampling differ from the plan: rank 1 (stage 1)",
        ),
    ],
)
def test_ranks_whose_messages_disagree_stop_with_a_named_error(tmp_path, fault, message):
    started = time.monotonic()
    result = ranks(
        2,
        "infer.py",
        *SAMPLE[:-2],
        "a red square",
        f"run.output_dir={tmp_path}",
        "--output",
        str(tmp_path / "x.npy"),
        "parallel.pipefusion=2",
        timeout=80,
        env={"TESSERA_FAULT": fault},
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert result.stderr.count(f"error: {message}") == 2, result.stderr[-3000:]  # both ranks say the same
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert elapsed < 60, elapsed  # seconds, not a watchdog timeout
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.timeout(90)
def test_a_replica_without_prompts_does_not_wait_for_the_others(tmp_path):
    """dp=2 and one prompt: rank 1 has nothing to sample and leaves at once; it must not sit in a barrier
    whose control timeout (1 s here) runs out while rank 0 samples, which would abort rank 0's run."""
    result = ranks(
        2,
        "infer.py",
        *SAMPLE[:-2],
        "a red square",
        "--steps",
        "12",
        "model.size=DiT-demo",
        f"run.output_dir={tmp_path}",
        "--output",
        str(tmp_path / "x.npy"),
        "parallel.control_timeout_s=1",
        timeout=80,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "x.npy").exists()


@pytest.mark.timeout(120)
def test_infer_shares_the_vae_tiles_and_equals_one_process(tmp_path):
    """A kl VAE with small tiles (a 5 x 3 latent in 8 tiles of 2 x 2, overlapping by 1): under cfg=2 the two
    ranks decode half the tiles each and gather them (tests/vae_worker.py checks the sharing itself);
    the video equals the one-process tiled decode."""
    import infer
    from tests.conftest import run_main

    vae = ["vae.kind=kl", "vae.tile_latent=2", "vae.tile_overlap=1", "model.patch_size=[1,1,1]"]
    args = [*SAMPLE[:-2], "a red square", *vae]
    assert (
        run_main(infer, args + [f"run.output_dir={tmp_path / 'one'}", "--output", str(tmp_path / "one.npy")])
        == 0
    )
    result = ranks(
        2,
        "infer.py",
        *args,
        f"run.output_dir={tmp_path / 'two'}",
        "--output",
        str(tmp_path / "two.npy"),
        "parallel.cfg=2",
        timeout=100,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "VAE decode: 8 tile(s) over 2 rank(s)" in result.stdout
    assert np.abs(np.load(tmp_path / "two.npy") - np.load(tmp_path / "one.npy")).max() <= 1e-5
