"""Sequence-parallel attention against single-process attention, in several processes (gloo, CPU;
tests/ranks.py starts them as torchrun does).

The checks themselves live in tests/sp_worker.py: one launch per process count runs every layout
and token count, because each process pays seconds of imports.
"""

import math

import pytest

from tests.conftest import ranks

FOUR_PROCESS_LAYOUTS = ["u4r1", "u1r4", "u2r2", "u2r1", "u1r2"]


def _passed(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [line for line in result.stdout.splitlines() if line.startswith("ok ")]


@pytest.mark.slow  # four processes, every split: the whole suite's (training under ulysses and ring stays)
@pytest.mark.timeout(180)
def test_four_processes_ulysses_ring_and_hybrid():
    passed = _passed(ranks(4, "tests/sp_worker.py", timeout=150))
    for layout in FOUR_PROCESS_LAYOUTS:
        p = 4 if layout in ("u4r1", "u1r4", "u2r2") else 2
        for tokens in (6 * p, 6 * p - 1, p + 1):
            for part in ("forward", "dq", "dk", "dv"):
                assert any(
                    line.startswith(f"ok attention {layout} N={tokens} {part} (") for line in passed
                ), (layout, tokens, part)
        assert sum(line.startswith(f"ok DiT {layout} ") for line in passed) == 6, layout
        assert sum(line.startswith(f"ok WanDiT {layout} ") for line in passed) == 2, layout  # Wan's options
        assert sum(line.startswith(f"ok WanI2V {layout} ") for line in passed) == 2, layout  # image-to-video
        if "r1" not in layout:  # ring layouts: the reference kernel with chunked p2p, and bf16
            assert sum(" math kernel, chunked p2p " in line and f" {layout} " in line for line in passed) == 4
            assert sum(" bf16 " in line and f" {layout} " in line for line in passed) == 4
    assert "ok chunked collectives identical" in passed


@pytest.mark.timeout(180)
def test_three_process_ring():
    passed = _passed(ranks(3, "tests/sp_worker.py", timeout=150))
    assert sum(line.startswith("ok attention u1r3 ") for line in passed) == 12 + 8
    assert sum(line.startswith("ok DiT u1r3 ") for line in passed) == 6
    assert sum(line.startswith("ok WanDiT u1r3 ") for line in passed) == 2
    assert sum(line.startswith("ok WanI2V u1r3 ") for line in passed) == 2


# --- The whole programs under sequence-parallel layouts, against one process. ---------------------

import numpy as np  # noqa: E402

import infer  # noqa: E402
import train  # noqa: E402
from configs.rundir import read_metrics  # noqa: E402
from tests.conftest import TINY, run_main  # noqa: E402

# 3 x 5 x 3 = 45 tokens: divisible by neither 2 nor 4, so the padded path runs in every layout.
SAMPLE = [
    "--config",
    str(TINY),
    "--random-weights",
    "--steps",
    "2",
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
def single_process_videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    assert run_main(infer, SAMPLE + [f"run.output_dir={folder}", "--output", str(folder / "x.npy")]) == 0
    videos = [np.load(folder / f"x_{i:03d}.npy") for i in range(2)]
    assert np.abs(videos[0] - videos[1]).max() > 1e-2  # the prompts (and seeds) give different videos
    return videos


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "nproc,layout,agent_store",
    [
        (2, ["parallel.ulysses=2"], True),
        (2, ["parallel.ring=2"], False),  # started as srun would: rank 0 hosts the store
        (3, ["parallel.ring=3"], True),
        (4, ["parallel.ulysses=2", "parallel.ring=2"], True),
        (4, ["parallel.dp=2", "parallel.ring=2"], True),
    ],
)
def test_infer_under_layout_equals_one_process(tmp_path, single_process_videos, nproc, layout, agent_store):
    result = ranks(
        nproc,
        "infer.py",
        *SAMPLE,
        f"run.output_dir={tmp_path}",
        "--output",
        str(tmp_path / "x.npy"),
        *layout,
        timeout=200,
        agent_store=agent_store,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for i, expected in enumerate(single_process_videos):
        assert np.abs(np.load(tmp_path / f"x_{i:03d}.npy") - expected).max() < 1e-5


SELECTIVE = ["train.activation_checkpointing=true", "train.checkpoint_policy=selective"]


@pytest.mark.timeout(420)
def test_training_under_ulysses_and_ring_equals_one_process(tmp_path):
    """Same recipe, same data: the sequence-parallel ranks of one group share each sample, and FSDP over
    dp x ring gives the single-process gradients (grad norm) and losses; the last layout recomputes
    its blocks selectively in backward (train.checkpoint_policy=selective), ring passes included."""
    common = [
        "--config",
        str(TINY),
        "train.max_steps=3",
        "train.checkpoint_every=3",
        "train.sample_every=0",
        "data.frames=3",
        "data.height=20",
        "data.width=12",  # 45 tokens: padded under every layout
        "data.synthetic_samples=4",
    ]  # one batch of 4 per epoch, or two of 2 under dp=2: the same samples
    assert run_main(train, common + [f"run.output_dir={tmp_path / 'one'}"]) == 0
    reference = loss_and_grad_norm(tmp_path / "one")
    assert sorted(reference) == [1, 2, 3]  # the comparisons below run over these steps
    for nproc, layout in (
        (2, ["parallel.ulysses=2"]),
        (2, ["parallel.ring=2"]),
        (4, ["parallel.dp=2", "parallel.ring=2", "train.batch_size=2", *SELECTIVE]),
    ):  # same 4 samples
        run_dir = tmp_path / "_".join(layout).replace("=", "")
        result = ranks(nproc, "train.py", *common, f"run.output_dir={run_dir}", *layout, timeout=170)
        assert result.returncode == 0, result.stderr[-4000:]
        assert logged_layout(result.stdout) == layout_run(nproc, layout), result.stdout[-2000:]
        got = loss_and_grad_norm(run_dir)
        assert got.keys() == reference.keys()
        # AdamW barely sees a gradient scale error; the grad norm does.
        assert all(got[s] == pytest.approx(reference[s], rel=1e-4) for s in reference), (
            layout,
            reference,
            got,
        )


def logged_layout(stdout: str) -> dict:
    """The degrees of train.py's one start-up summary line ("...; layout dp=1, cfg=1, ...; cpu ...")."""
    lines = [line for line in stdout.splitlines() if line.startswith("[tessera] ") and "; layout " in line]
    assert len(lines) == 1, lines
    degrees = lines[0].split("; layout ", 1)[1].split(";", 1)[0].removesuffix(" (parallel.auto)")
    return {name: int(value) for name, value in (d.split("=") for d in degrees.split(", "))}


def layout_run(nproc: int, overrides: list) -> dict:
    """Every degree of the layout a launch runs: the overrides given, 1 for the others, and dp what the
    process count leaves (parallel.dp=-1, the default)."""
    given = dict(o.removeprefix("parallel.").split("=") for o in overrides if o.startswith("parallel."))
    degrees = {name: int(given.get(name, 1)) for name in ("dp", "cfg", "pipefusion", "ulysses", "ring")}
    if "dp" not in given:
        degrees["dp"] = nproc // math.prod(degrees.values())
    return degrees


def loss_and_grad_norm(run_dir):
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(run_dir)}
