"""The step cache (sample.cache): the calibrated plan and the first-block rule against the rules written out
by hand, the cached sampler against the uncached one, every layout against one process (the same calls
saved, the same video), ranks whose signals or settings differ (they agree, or stop with an `error:`
line), and the refusals at start-up."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import infer
from models.step_cache import (
    CacheError,
    Calibration,
    FirstBlockCache,
    FirstBlockFamily,
    StepCache,
    plan_steps,
)
from tests.conftest import ROOT, TINY, ranks, run_main

sys.path.insert(0, str(ROOT / "scripts"))

# 45 tokens a frame-stack (3 x 3 x 5 with the tiny recipe's 1 x 4 x 4 patches): no degree divides them
SIZE = ["--frames", "3", "--height", "12", "--width", "20", "--steps", "8", "--random-weights"]
PROMPTS = ["--prompt", "a red square moving left", "a blue circle moving right"]


def calibration(steps=8, change=0.1, magnitude=0.9) -> Calibration:
    return Calibration(
        steps, [float("nan")] + [change] * (steps - 1), [float("nan")] + [magnitude] * (steps - 1)
    )


def for_random_weights(table: Calibration) -> Calibration:
    """A hand-made table, recorded as made for infer.py --random-weights with the tiny recipe."""
    from configs import load_config
    from parallel.compute.cache import calibration_subject

    table.made_for = calibration_subject(load_config(TINY), None, True, True, [], 2.0)
    return table


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
    from models.dit.family import sample_dit
    from models.flow import RectifiedFlow

    calls = []

    def velocity(x, sigma):
        calls.append(float(sigma))
        return x * float(sigma) + 1.0

    noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    cache = StepCache(calibration(6, change=0.1, magnitude=0.8), threshold=0.15, max_skips=2)
    flow = RectifiedFlow(load_config(None).flow, (1, 2, 2), cache)
    out = sample_dit(flow, None, noise, None, None, steps=6, velocity=velocity)
    assert len(calls) == 4  # the model itself was called on the plan's 4 computed steps only
    sigmas, x, last = flow.sigmas(noise, 6), noise, None
    for i, step in enumerate(cache.plan(6)):
        last = velocity(x, sigmas[i]) if step.compute else last
        x = x + (sigmas[i + 1] - sigmas[i]) * (last if step.compute else last * step.scale)
    assert torch.allclose(out, x) and flow.model_calls == sum(s.compute for s in cache.plan(6)) == 4


def test_the_first_block_rule_written_out_by_hand():
    """Calls of a tiny DiT under FirstBlockCache against its pieces run by hand, two samples: the first call
    runs every block; in the second both first-block residuals barely changed, so both reuse the other
    blocks' residual; in the third one sample changed too much and runs every block alone, the other
    reuses again; in the fourth (the last step) both run every block."""
    from models.dit.family import DiTText
    from models.dit.transformer import DiT

    torch.manual_seed(0)
    model = DiT(4, 16, depth=3, hidden_size=32, num_heads=4, patch_size=(1, 2, 2)).eval()
    model.init_weights(zero_init=False, seed=3)
    x = torch.randn(2, 4, 2, 4, 4)
    t, y, mask = torch.full((2,), 0.5), torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool)

    def by_hand(x, rest=None):
        tokens, grid = model.embed(x)
        rope, cond = model.rope(grid, "cpu"), model.condition(t, y, mask)
        first = model.blocks[0](tokens, cond.c, cond.y, cond.block_mask, rope)
        out = first
        for block in model.blocks[1:]:
            out = block(out, cond.c, cond.y, cond.block_mask, rope)
        blocks_out = out if rest is None else first + rest
        return model.unpatchify(model.final_layer(blocks_out, cond.temb), grid), first - tokens, out - first

    def change(r, r_full):
        return (r - r_full).abs().flatten(1).sum(1) / r_full.abs().flatten(1).sum(1)

    cache = FirstBlockCache(threshold=0.05, max_skips=2)
    family = FirstBlockFamily(model, cache)  # the DiT's patch pieces around the cache's decision
    cached = lambda x, t, y, mask: family(x, t, DiTText(y, mask))[0]  # noqa: E731
    cache.start(steps=4, samples=2)
    with torch.no_grad():
        full, r0, rest = by_hand(x)
        assert torch.allclose(cached(x, t, y, mask), full, atol=1e-6)
        near = x + 1e-3 * torch.randn_like(x)
        cache.begin_step(1)
        reused, r1, _ = by_hand(near, rest)
        assert (change(r1, r0) < 0.05).all()
        assert torch.allclose(cached(near, t, y, mask), reused, atol=1e-6) and cache.full_calls == 1
        mixed = torch.stack([x[0] + 2e-3 * torch.randn_like(x[0]), x[1] + 0.5 * torch.randn_like(x[1])])
        cache.begin_step(2)
        (reused, r2, _), (computed, _, _) = by_hand(mixed, rest), by_hand(mixed)
        assert change(r2, r0)[0] < 0.05 < change(r2, r0)[1]
        assert torch.allclose(cached(mixed, t, y, mask), torch.stack([reused[0], computed[1]]), atol=1e-6)
        cache.begin_step(3)  # the last step: every block, whatever the change
        assert torch.allclose(cached(near, t, y, mask), by_hand(near)[0], atol=1e-6)
    assert cache.decisions == [[False, False], [True, True], [True, False], [False, False]]
    assert cache.full_calls == 2.5  # per sample: 1 + 0 + 0.5 + 1
    assert torch.allclose(model(mixed, t, y, mask), by_hand(mixed)[0], atol=1e-6)  # off: every block

    # Guided, as the serial sampler batches it: rows = (conditional, unconditional) x 2 samples, one
    # decision per sample over both of its rows (0 and 2, 1 and 3).
    t, y, mask = torch.full((4,), 0.5), torch.randn(4, 5, 16), torch.ones(4, 5, dtype=torch.bool)
    cache = FirstBlockCache(threshold=0.05, max_skips=2)
    family = FirstBlockFamily(model, cache)  # each branch's first block, one decision over both

    def cached(x, t, y, mask):  # the rows as the serial sampler batched them: conditional, then not
        half = len(x) // 2
        branches = DiTText(y[:half], mask[:half]), DiTText(y[half:], mask[half:])
        return torch.cat(family(x[:half], t[:half], *branches))

    cache.start(steps=4, samples=2)
    with torch.no_grad():
        _, r0, rest = by_hand(torch.cat([x, x]))
        cached(torch.cat([x, x]), t, y, mask)
        cache.begin_step(1)
        (reused, r2, _), (computed, _, _) = (
            by_hand(torch.cat([mixed, mixed]), rest),
            by_hand(torch.cat([mixed, mixed])),
        )
        l1 = lambda r: r.abs().flatten(1).sum(1).view(2, 2).sum(0)  # noqa: E731  (per sample, both rows)
        per_sample = l1(r2 - r0) / l1(r0)
        assert per_sample[0] < 0.05 < per_sample[1]
        expected = torch.stack([reused[0], computed[1], reused[2], computed[3]])
        assert torch.allclose(cached(torch.cat([mixed, mixed]), t, y, mask), expected, atol=1e-6)
    assert cache.decisions[-1] == [True, False]


def cached_sample(tmp_path, name, calibration_file, *extra, nproc=1, env=None):
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
    if calibration_file is not None:
        args += ["sample.cache=calibrated", f"sample.cache_calibration={calibration_file}"]
    args += extra
    if nproc == 1:
        assert run_main(infer, args) == 0
        return np.stack([np.load(out.with_name(f"{name}_{i:03d}.npy")) for i in range(2)]), None
    result = ranks(nproc, "infer.py", *args, timeout=90, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return np.stack([np.load(out.with_name(f"{name}_{i:03d}.npy")) for i in range(2)]), result.stdout


def test_every_layout_samples_the_one_process_cached_video(tmp_path, capsys):
    """cfg 2 x ulysses 2 (4 processes) and ring 2: the same calls skipped and the same video as one
    process (45 tokens: no degree divides them); the cache changes the video, and saves calls."""
    file = tmp_path / "cache.json"
    for_random_weights(calibration(8, change=0.1)).save(file)
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


FIRST_BLOCK = ["sample.cache=first_block", "sample.cache_first_block_threshold=0.03"]


def test_first_block_decisions_are_agreed_across_ranks(tmp_path, capsys):
    """sample.cache=first_block under cfg 2 x ring 2 (4 processes, 45 tokens): the one-process decisions and
    video. A rank whose own share of the signal is inflated (TESSERA_FAULT=cache_signal@1) cannot make
    the ranks disagree: the summed signal is the same on each, so all of them run more blocks, alike."""
    ours, _ = cached_sample(tmp_path, "one", None, *FIRST_BLOCK)
    assert "step cache: 5 of 8 steps ran every block" in capsys.readouterr().out  # steps 3, 5, 6 reuse
    theirs, stdout = cached_sample(
        tmp_path, "cfg_ring", None, *FIRST_BLOCK, "parallel.cfg=2", "parallel.ring=2", nproc=4
    )
    assert "step cache: 5 of 8 steps ran every block" in stdout
    assert np.abs(theirs - ours).max() <= 1e-5
    faulty, stdout = cached_sample(
        tmp_path,
        "fault",
        None,
        *FIRST_BLOCK,
        "parallel.ulysses=2",
        nproc=2,
        env={"TESSERA_FAULT": "cache_signal@1"},
    )
    assert "step cache: 8 of 8 steps ran every block" in stdout  # agreed (checked at the end), not hung
    assert np.abs(faulty - ours).max() > 1e-4
    # A rank that decides otherwise from the agreed sums (cfg 2: no collective inside the blocks would
    # notice) is caught by the check after sampling: one error line, no video written.
    args = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", *SIZE, *PROMPTS, *FIRST_BLOCK]
    result = ranks(
        2,
        "infer.py",
        *args,
        "parallel.cfg=2",
        "--output",
        str(tmp_path / "flip.npy"),
        timeout=90,
        env={"TESSERA_FAULT": "cache_decision@1"},
    )
    assert (
        result.returncode != 0
        and "error: the ranks sampling one video differ in the step cache's decisions" in result.stderr
    )
    assert not list(tmp_path.glob("flip*.npy"))


def test_cache_settings_a_layout_cannot_honour_are_refused_at_start(tmp_path, capsys):
    file = tmp_path / "cache.json"
    for_random_weights(calibration(6)).save(file)
    base = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", *SIZE[:-3], "--random-weights"]
    for extra, message in (
        (["sample.cache=calibrated"], "needs sample.cache_calibration"),
        (["sample.cache=calibrated", f"sample.cache_calibration={file}", "--steps", "8"], "made for 6 steps"),
        (["sample.cache=teacache"], "choose one of none, calibrated"),
    ):
        assert run_main(infer, base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert run_main(infer, base + ["parallel.pipefusion=2", "sample.cache=first_block"]) == 2
    assert "first_block cannot run under PipeFusion" in capsys.readouterr().err
    # a rank with another threshold (as if it read another recipe) is named before any weight is loaded
    calibrated = ["sample.cache=calibrated", f"sample.cache_calibration={file}", "--steps", "6"]
    result = ranks(
        2,
        "infer.py",
        *base,
        *calibrated,
        "parallel.pipefusion=2",
        timeout=60,
        env={"TESSERA_FAULT": "cache_plan@1"},
    )
    assert 2 in result.codes, result.stderr[-2000:]  # a user error
    assert (
        "error: the ranks sampling one video differ in what decides the step cache's skips (replica rank 0:"
        in result.stderr
    )


@pytest.mark.slow
def test_a_calibration_does_not_depend_on_the_batches(tmp_path):
    """calibrate_cache.py samples through infer.py, sample.batch_size prompts at a time: the table has the
    steps asked for, and the same changes as one batch of them all."""
    import calibrate_cache

    args = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "--random-weights", "--steps", "3"]
    args += ["--seeds", "2", "--prompts", "a red square", "a blue circle"]
    for size in (1, 4):
        out = tmp_path / f"{size}.json"
        assert run_main(calibrate_cache, [*args, "--output", str(out), f"sample.batch_size={size}"]) == 0
    one, four = (Calibration.load(tmp_path / f"{n}.json") for n in (1, 4))
    assert one.steps == four.steps == 3
    assert np.allclose(one.change[1:], four.change[1:], rtol=1e-5) and one.change[1] > 0


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


def calibrate(tmp_path, name, *extra) -> Path:
    """scripts/calibrate_cache.py on the tiny recipe (3 steps, one seed); the file it wrote."""
    import calibrate_cache

    out = tmp_path / f"{name}.json"
    args = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "--seeds", "1", *extra]
    assert run_main(calibrate_cache, [*args, "--output", str(out)]) == 0
    return out


def test_a_calibration_made_for_another_sampling_is_refused_by_what_differs(tmp_path, capsys):
    """Item 7: a calibration of one model, checkpoint or guidance was accepted for any other (only the step
    count was compared). Each difference is now named, before init_runtime; the same sampling is accepted."""
    import torch.distributed as dist

    import train

    run, out = tmp_path / "run", str(tmp_path / "v.npy")
    base = ["--config", str(TINY), f"run.output_dir={run}", "--output", out]
    assert run_main(train, ["--config", str(TINY), f"run.output_dir={run}", "train.max_steps=1"]) == 0
    step_1 = run / "checkpoints" / "step_1"
    random_file, step_1_file = (
        calibrate(tmp_path, "random", "--random-weights"),
        calibrate(tmp_path, "step_1"),
    )
    assert run_main(infer, [*base, "sample.cache=calibrated", f"sample.cache_calibration={step_1_file}"]) == 0
    assert run_main(train, ["--config", str(TINY), f"run.output_dir={run}", "train.max_steps=2"]) == 0
    capsys.readouterr()
    for file, extra, differs in (
        (random_file, ["--random-weights", "--guidance", "3"], "guidance: 2.0 there, 3.0 here"),
        (random_file, ["--random-weights", "model.base_dtype=float8"], "base_dtype: 'auto' there, 'float8'"),
        (
            random_file,
            ["--random-weights", "model.patch_size=[1,2,2]"],
            "model.patch_size: [1, 4, 4] there, [1, 2, 2] here",
        ),
        (
            random_file,
            ["--checkpoint", str(step_1)],
            f"weights: random weights (train.seed=0) there, checkpoint {step_1} (EMA weights) here",
        ),
        (
            step_1_file,
            [],
            f"weights: checkpoint {step_1} (EMA weights) there, checkpoint {step_1.with_name('step_2')} (EMA "
            "weights) here",
        ),
        (
            step_1_file,
            ["--checkpoint", str(step_1), "--no-ema"],
            f"weights: checkpoint {step_1} (EMA weights) there, checkpoint {step_1} (raw weights) here",
        ),
    ):
        argv = [*base, *extra, "sample.cache=calibrated", f"sample.cache_calibration={file}"]
        assert run_main(infer, argv) == 2, extra
        line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error:"))
        assert f"sample.cache_calibration={file} was made for another sampling: {differs}" in line, line
        assert not dist.is_initialized()  # refused before any process group, model or weight
    # a file from before the record is refused too: it cannot be checked
    old = json.loads(random_file.read_text())
    del old["made_for"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    argv = [
        *base,
        "--random-weights",
        "sample.cache=calibrated",
        f"sample.cache_calibration={tmp_path / 'old.json'}",
    ]
    assert run_main(infer, argv) == 2
    assert "does not record what it was made for" in capsys.readouterr().err


def test_a_calibration_records_the_familys_conditioning_settings(monkeypatch):
    """A table is measured on the velocities of one conditioning: calibrated where the family's own settings
    change it (Family.latent_record: Qwen-Image-Edit's model.reference_area), it is refused at another
    value, by name, both ways; at the defaults nothing is recorded that a table written before lacks."""
    from configs import load_config
    from models.families import family_named
    from parallel.compute.cache import calibration_subject

    cfg = load_config(TINY)
    family = type(family_named(cfg.model.family))
    table = for_random_weights(calibration())
    del table.made_for["conditioning"]  # a table written before the record
    table.check_made_for(calibration_subject(cfg, None, True, True, [], 2.0), "old.json")
    monkeypatch.setattr(family, "latent_record", lambda self, cfg: {"reference_area": 65536})
    smaller = calibration_subject(cfg, None, True, True, [], 2.0)
    differs = "conditioning: the family's defaults there, reference_area=65536 here"
    with pytest.raises(CacheError, match=differs):
        table.check_made_for(smaller, "old.json")
    table.made_for = smaller
    monkeypatch.undo()
    differs = "conditioning: reference_area=65536 there, the family's defaults here"
    with pytest.raises(CacheError, match=differs):
        table.check_made_for(calibration_subject(cfg, None, True, True, [], 2.0), "c.json")


@pytest.mark.parametrize(
    "entry, value, message",
    [
        ("magnitude", 1e30, "magnitude[1] is 1e+30, outside 1 +- change[1]"),
        ("magnitude", float("nan"), "magnitude[1] is nan, outside 1 +- change[1]"),
        ("change", float("inf"), "change[1] is inf, outside [0, 10]"),
        ("change", -0.5, "change[1] is -0.5, outside [0, 10]"),
    ],
)
def test_calibration_values_that_no_measurement_gives_are_refused(tmp_path, capsys, entry, value, message):
    """Item 5 (c): a calibration with magnitude 1e30 sampled a video of NaN with exit 0 (a skipped step's
    velocity is the last one times the magnitude). Such a file is refused, naming the file and the entry."""
    good = calibrate(tmp_path, "good", "--random-weights", "--steps", "3")
    body = json.loads(good.read_text())
    body[entry][1] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(body))
    with pytest.raises(CacheError, match=re.escape(f"sample.cache_calibration={bad}: {message}")):
        Calibration.load(bad)
    argv = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "--random-weights", "--output"]
    argv += [str(tmp_path / "v.npy"), "sample.cache=calibrated", f"sample.cache_calibration={bad}"]
    assert run_main(infer, argv) == 2
    assert f"error: sample.cache_calibration={bad}: {message}" in capsys.readouterr().err
    assert not list(tmp_path.glob("v*.npy"))


def test_a_calibration_of_a_lora_is_accepted_with_that_lora_only(tmp_path, capsys):
    """calibrate_cache.py --lora measures the weights infer.py --lora samples: that sampling accepts it (it
    could not before: the calibration always recorded no LoRA), one without the LoRA is refused by name."""
    from safetensors.torch import save_file

    from configs import load_config
    from models.dit.family import meta_dit
    from models.lora_formats import export_adapters, model_projections

    projections, linears = model_projections(meta_dit(load_config(TINY)))
    module = next(name for name in linears if name.startswith("blocks.0."))
    d_in, d_out = linears[module]
    generator = torch.Generator().manual_seed(0)
    A, B = torch.randn(2, d_in, generator=generator), torch.randn(d_out, 2, generator=generator)
    lora = tmp_path / "lora.safetensors"
    save_file(export_adapters({module: (A, B, 0.5)}, projections, "diffusers"), str(lora))
    file = calibrate(tmp_path, "lora", "--random-weights", "--lora", str(lora))
    base = ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}", "--output", str(tmp_path / "v.npy")]
    cached = ["--random-weights", "sample.cache=calibrated", f"sample.cache_calibration={file}"]
    assert run_main(infer, [*base, *cached, "--lora", str(lora)]) == 0
    capsys.readouterr()
    assert run_main(infer, [*base, *cached]) == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error:"))
    assert f"loras: {lora}:1 there, none here" in line, line
