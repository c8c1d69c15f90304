"""The step cache (sample.cache): its plan against the rule written out by hand, the cached sampler against
the uncached one, every layout against one process (the same calls saved, the same video), and the
refusals at start-up. The plan is made of values identical on every rank, so no layout can disagree."""

import json
import sys

import numpy as np
import pytest
import torch

import infer
from models.step_cache import CacheError, Calibration, StepCache, plan_steps
from tests.conftest import ROOT, TINY, run_main, torchrun

sys.path.insert(0, str(ROOT / "scripts"))

# 45 tokens a frame-stack (3 x 3 x 5 with the tiny recipe's 1 x 4 x 4 patches): no degree divides them
SIZE = ["--frames", "3", "--height", "12", "--width", "20", "--steps", "8", "--random-weights"]
PROMPTS = ["--prompt", "a red square moving left", "a blue circle moving right"]


def calibration(steps=8, change=0.1, magnitude=0.9) -> Calibration:
    return Calibration(
        steps, [float("nan")] + [change] * (steps - 1), [float("nan")] + [magnitude] * (steps - 1)
    )


def test_the_plan_skips_within_the_budget_and_keeps_the_ends():
    plan = plan_steps(calibration(8, change=0.1), 8, threshold=0.25, max_skips=3)
    # 0.1 + 0.1 fits 0.25, a third 0.1 does not: compute, skip, skip, compute, ...; the last step computes
    assert [s.compute for s in plan] == [True, False, False, True, False, False, True, True]
    assert [round(s.scale, 6) for s in plan[:3]] == [1.0, 0.9, 0.81]
    capped = plan_steps(calibration(8, change=0.01), 8, threshold=1.0, max_skips=1)
    assert [s.compute for s in capped] == [True, False, True, False, True, False, True, True]
    assert all(s.compute for s in plan_steps(calibration(8, change=0.5), 8, 0.25, 3))
    with pytest.raises(CacheError, match="made for 8 steps, and this sampling takes 10"):
        plan_steps(calibration(8), 10, 0.25, 3)


def test_a_calibration_round_trips_and_a_damaged_one_is_refused(tmp_path):
    velocities = [torch.full((2, 3), 4.0), torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)]
    measured = Calibration.measure(velocities, "hand-made")
    assert measured.change[1:] == pytest.approx([0.5, 0.5]) and measured.magnitude[1:] == pytest.approx(
        [0.5, 1.5]
    )
    measured.save(tmp_path / "c.json")
    again = Calibration.load(tmp_path / "c.json")
    assert again.steps == 3 and again.change[1:] == measured.change[1:]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CacheError, match="cannot be read as a calibration"):
        Calibration.load(tmp_path / "bad.json")


def test_the_cached_sampler_reuses_the_last_velocity_scaled():
    """Against the Euler loop written out by hand with the plan's reuse: a velocity that counts its calls."""
    from configs import load_config
    from models.flow import RectifiedFlow

    calls = []

    def velocity(x, sigma):
        calls.append(float(sigma))
        return x * float(sigma) + 1.0

    noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    cache = StepCache(calibration(6, change=0.1, magnitude=0.8), threshold=0.15, max_skips=2)
    flow = RectifiedFlow(load_config(None).flow, (1, 2, 2), cache)
    out = flow.sample(None, noise, None, None, steps=6, velocity=velocity)
    sigmas, x, last = flow.sigmas(noise, 6), noise, None
    for i, step in enumerate(cache.plan(6)):
        last = velocity(x, sigmas[i]) if step.compute else last
        x = x + (sigmas[i + 1] - sigmas[i]) * (last if step.compute else last * step.scale)
    assert torch.allclose(out, x) and flow.model_calls == sum(s.compute for s in cache.plan(6)) == 4


def cached_sample(tmp_path, name, calibration_file, *extra, nproc=1):
    out = tmp_path / f"{name}.npy"
    args = [
        "--config",
        str(TINY),
        f"run.output_dir={tmp_path / 'run'}",
        *SIZE,
        *PROMPTS,
        "--output",
        str(out),
    ]
    args += ["sample.cache=calibrated", f"sample.cache_calibration={calibration_file}", *extra]
    if nproc == 1:
        assert run_main(infer, args) == 0
        return np.stack([np.load(out.with_name(f"{name}_{i:03d}.npy")) for i in range(2)]), None
    result = torchrun(nproc, "infer.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.stack([np.load(out.with_name(f"{name}_{i:03d}.npy")) for i in range(2)]), result.stdout


def test_every_layout_samples_the_one_process_cached_video(tmp_path, capsys):
    """cfg 2 x ulysses 2 (4 processes) and ring 2: the same calls skipped and the same video as one
    process (45 tokens: no degree divides them); the cache changes the video, and saves calls."""
    file = tmp_path / "cache.json"
    calibration(8, change=0.1).save(file)
    # the recipe's default budget (0.3, 2 in a row) on this table: steps 0, 3, 6 and 7 call the model
    assert [s.compute for s in plan_steps(calibration(8), 8, 0.3, 2)] == [1, 0, 0, 1, 0, 0, 1, 1]
    ours, _ = cached_sample(tmp_path, "one", file)
    assert "step cache: 4 of 8 steps call the model" in capsys.readouterr().out
    plain = tmp_path / "plain.npy"
    args = [
        "--config",
        str(TINY),
        f"run.output_dir={tmp_path / 'run'}",
        *SIZE,
        *PROMPTS,
        "--output",
        str(plain),
    ]
    assert run_main(infer, args) == 0
    uncached = np.stack([np.load(plain.with_name(f"plain_{i:03d}.npy")) for i in range(2)])
    assert np.abs(uncached - ours).max() > 1e-4  # the cache did something
    for name, nproc, layout in (
        ("cfg_ulysses", 4, ["parallel.cfg=2", "parallel.ulysses=2"]),
        ("ring", 2, ["parallel.ring=2"]),
    ):
        theirs, stdout = cached_sample(tmp_path, name, file, *layout, nproc=nproc)
        assert "step cache: 4 of 8 steps call the model" in stdout, name
        assert np.abs(theirs - ours).max() <= 1e-5, name


def test_cache_settings_a_layout_cannot_honour_are_refused_at_start(tmp_path, capsys):
    file = tmp_path / "cache.json"
    calibration(6).save(file)
    base = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", *SIZE[:-3], "--random-weights"]
    for extra, message in (
        (["sample.cache=calibrated"], "needs sample.cache_calibration"),
        (["sample.cache=calibrated", f"sample.cache_calibration={file}", "--steps", "8"], "made for 6 steps"),
        (["sample.cache=teacache"], "choose one of none, calibrated"),
    ):
        assert run_main(infer, base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    pipefusion = ["parallel.pipefusion=2", "sample.cache=calibrated", f"sample.cache_calibration={file}"]
    result = torchrun(2, "infer.py", *base, "--steps", "6", *pipefusion)
    assert result.returncode != 0 and "not built for PipeFusion yet" in result.stderr


def test_calibrate_and_bench_cache_run(tmp_path):
    import bench_cache
    import calibrate_cache

    out = tmp_path / "c.json"
    args = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "--random-weights", "--seeds", "1"]
    assert run_main(calibrate_cache, [*args, "--output", str(out)]) == 0
    found = Calibration.load(out)
    assert found.steps == 3 and all(c > 0 for c in found.change[1:])
    report = tmp_path / "bench.json"
    assert run_main(bench_cache, ["--tiny", "--json", str(report), f"run.output_dir={tmp_path / 'run'}"]) == 0
    rows = json.loads(report.read_text())["rows"]
    assert rows[0]["calls"] == 6 and all(r["calls"] <= 6 and r["psnr"] > 0 for r in rows[1:])
