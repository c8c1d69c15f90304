"""Every script in scripts/ runs in the suite, so none can rot unnoticed (issue 20).

The benchmarks run here in their tiny mode (`--tiny`, or TESSERA_TINY=1: tiny sizes on CPU, seconds),
each in its own process under a timeout, and each is checked on what it wrote (its --json and a row of
its table), not only on its exit code. The scripts another test already runs are listed in COVERED with
that test; the shell scripts users run by hand are listed in NOT_RUN with the reason. A script added to
scripts/ that is in none of these places fails test_every_script_has_a_test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import benchlib  # noqa: E402

SCRIPTS = ROOT / "scripts"
TINY = [  # run below
    "bench_checkpoint.py",
    "bench_data.py",
    "bench_lora.py",
    "bench_metadata.py",
    "bench_sampling.py",
    "bench_sp.py",
    "bench_startup_memory.py",
    "bench_vae.py",
    "family_memory.py",
    "card_memory.py",
    "model_scaling.py",  # its functions: tests/test_model_scaling.py
    "make_demo_data.py",  # a user tool: its command line on a few small clips
    "benchlib.py",  # the benchmarks' shared helper: test_benchlib_*
]
COVERED = {  # script: the test that runs it (at tiny sizes)
    "bench_cache.py": "tests/test_step_cache.py::test_calibrate_and_bench_cache_run (--tiny)",
    "calibrate_cache.py": "tests/test_step_cache.py::test_calibrate_and_bench_cache_run",
    "bench_failures.py": "tests/test_failures.py::test_bench_failures_runs_and_writes_its_table (its --tiny)",
    "bench_gpu.py": "tests/test_bench_gpu.py::test_runs_tiny_on_cpu (--tiny)",
    "bench_watchdog.py": "tests/test_watchdog.py::test_bench_watchdog_runs (--calls 5, what --tiny sets)",
    "diagnose.py": "tests/test_failures.py (the records of failed runs: a stall, an extra collective)",
    "eval_demo.py": "tests/test_e2e.py::test_eval_demo_reports_every_rate_and_a_contact_sheet",
    "export.py": "tests/test_export.py and tests/test_wan_pipeline.py",
    "index_folder.py": "tests/test_decode.py::test_index_folder_probes_and_names_what_it_leaves_out",
    "precompute_latents.py": "tests/test_e2e.py::test_latent_vae_and_manifest_data (torchrun, 2 processes)",
    "slurm.sh": "tests/test_slurm.py (under a stand-in srun and scontrol)",
}
NOT_RUN = {  # the README's commands: what they run is tested piece by piece
    "demo.sh": "trains the demo for about 3 minutes; train.py, infer.py and eval_demo.py run in test_e2e.py",
    "demo_lora.sh": "trains a LoRA on the trained demo for minutes; data.synthetic_colors runs in "
    "test_data.py, eval_demo.py --colors in test_e2e.py, LoRA training on a tessera run in test_lora.py",
    "demo_distill.sh": "distils the trained demo for minutes; distillation (the demo's DiT as Wan) runs in "
    "test_distill.py, eval_demo.py in test_e2e.py",
    "install.sh": "installs packages with pip",
    "test.sh": "runs install.sh, then this suite",
}


def test_every_script_has_a_test():
    scripts = {p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")}
    listed = [*TINY, *COVERED, *NOT_RUN]
    assert sorted(listed) == sorted(scripts), "each script in exactly one of TINY, COVERED, NOT_RUN"
    for script, where in COVERED.items():  # the covering test exists and still runs the script
        test_file = ROOT / where.split("::")[0].split(" ")[0]
        assert script.rsplit(".", 1)[0] in test_file.read_text(), (script, where)


def run(script: str, *args: str, timeout: float = 120) -> str:
    """Run scripts/<script> from the repository root; its stdout, after asserting that it exited 0."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, (
        f"{script} {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )
    return done.stdout


def run_tiny(script: str, tmp_path: Path, *args: str) -> tuple[str, dict]:
    """`script --tiny --json FILE args`: its stdout and what it wrote."""
    out = run(script, "--tiny", "--json", str(tmp_path / "results.json"), *args)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["machine"]["torch"]  # benchlib.write_json says where it ran
    return out, results


@pytest.mark.slow
def test_model_scaling_tiny_probes_the_cpu_and_predicts(tmp_path):
    """The CPU probe (the script's default path, which crashed on a changed DiTBlock signature)."""
    out, results = run_tiny("model_scaling.py", tmp_path)
    probe, efficiency = results["probe"], results["efficiency"]
    assert probe["hidden"] == 64 and probe["seconds"] > 0 and 0 < efficiency <= 1
    assert results["flag"] == "CPU-scaled" and "MEASURED ON CPU" in out
    assert len(results["best"]) == 5 * 2  # every recipe fits on 8 and on 64 GPUs
    assert all(0 < b["mfu"] <= efficiency + 1e-9 for b in results["best"])
    assert len(results["anchors"]) == 4 and "| DiT-XL 256px | 8 | dp=8 " in out


@pytest.mark.slow
def test_bench_sp_tiny_bytes_match_theory_and_memory_divides(tmp_path):
    out, results = run_tiny("bench_sp.py", tmp_path)
    two = [r for r in results["worlds"]["2"] if "layout" in r]
    assert [r["layout"] for r in two] == ["ulysses=2 ring=1", "ulysses=1 ring=2"]
    for r in two:
        b = r["bytes"]
        assert b["forward"] == pytest.approx(b["theory_forward"], rel=1e-3), r
        assert b["backward"] == pytest.approx(b["theory_backward"], rel=1e-3), r
        assert r["time"]["step_s"] > 0
    alone = results["worlds"]["1"][0]["memory"]["saved_bytes"]
    assert all(r["memory"]["saved_bytes"] <= 1.2 / 2 * alone for r in two)
    assert "| ulysses=2 ring=1 | 0.12 MiB | 0.12 MiB | 1.00 |" in out
    assert results["worlds"]["2"][-1]["chunking"]["pieces"] == 4  # 1 MB in 0.25 MB pieces


@pytest.mark.slow
def test_bench_sampling_tiny_bytes_match_theory(tmp_path):
    out, results = run_tiny("bench_sampling.py", tmp_path, "--scratch", str(tmp_path / "scratch"))
    layouts = {b["layout"]: b for b in results["bytes"]}
    assert set(layouts) == {"pipefusion=2, M=2", "pipefusion=2, M=4", "cfg=2"}  # those that fit 2 processes
    for b in layouts.values():
        assert b["measured_over_theory"] == pytest.approx([1.0, 1.0], abs=1e-6), b
    assert layouts["pipefusion=2, M=2"]["weights"][0] < layouts["cfg=2"]["weights"][0]  # a stage holds less
    assert len(results["model"]) == 4 and all(m["auto_fits"] for m in results["model"].values())
    assert "| Wan2.1-14B (14.29B) | 8 |" in out


@pytest.mark.slow
def test_bench_vae_tiny_shares_the_tiles(tmp_path):
    out, results = run_tiny("bench_vae.py", tmp_path)
    for serial, shared in zip(results["runs"]["1"], results["runs"]["2"], strict=True):
        assert serial["kind"] == shared["kind"] and serial["tiles"] == shared["tiles"] == 6
        assert serial["whole"] > 0 and serial["tiles_per_rank"] == [6] and shared["tiles_per_rank"] == [3, 3]
        assert len(shared["rank_times"]) == 2 and shared["sent_mb"] > 0
    assert "| kl | 1x4x1x8x12 | 1x32x48 | 6 | 2 | [3, 3] |" in out


def test_bench_metadata_tiny_reads_the_same_metadata(tmp_path):
    """The safe .metadata reader's cost against pickle's, on a synthetic metadata both read alike."""
    out, results = run_tiny("bench_metadata.py", tmp_path)
    assert results["ratio"] > 0 and len(results["seconds"]) == 2 and "safe / plain" in out


@pytest.mark.slow
def test_bench_checkpoint_tiny_leaves_no_threads_behind(tmp_path):
    """The issue-12 fix: a save on a short-lived gloo group leaves the process's thread count as it was."""
    out, results = run_tiny("bench_checkpoint.py", tmp_path)
    rows = results["rows"]
    before, fixed = rows["before"], rows["after dcp.save, short-lived group (fix)"]
    assert fixed["threads"] == before["threads"], rows
    assert all(r["forward_backward_ms"] > 0 and r["optimizer_ms"] > 0 for r in rows.values())
    assert "| after dcp.save, long-lived group (old) |" in out


@pytest.mark.slow
def test_bench_startup_memory_tiny_measures_both_paths(tmp_path):
    out, results = run_tiny("bench_startup_memory.py", tmp_path)
    assert results["size"] == "DiT-tiny" and results["nproc"] == 2
    for path in ("whole", "meta"):
        peaks = results[path]["peak_gib"]
        assert len(peaks) == 2 and all(p >= results[path]["after_imports_gib"] > 0 for p in peaks)
    assert "| meta | " in out


@pytest.mark.slow
def test_bench_data_tiny_decodes_loads_and_resumes(tmp_path):
    out, results = run_tiny("bench_data.py", tmp_path, "--folder", str(tmp_path / "sources"))
    decode, memory, resume = results["decode"], results["memory"], results["resume"]
    assert results["sizes"]["clip"] == [8, 32, 32]
    assert decode["clips_per_s_one_process"] > 0 and decode["loader_clips_per_s_2_workers"] > 0
    assert len(memory["worker_growth_mb"]) == 2 and len(memory["rss_samples"]) == 10
    assert resume["manifest_size"] == 1000 and resume["ratio"] > 0
    assert "loader, 2 worker(s):" in out and "of (3, 8, 32, 32) uint8" in out


@pytest.mark.slow
def test_make_demo_data_writes_clips_and_a_manifest(tmp_path):
    out = run("make_demo_data.py", "--out", str(tmp_path), "--samples", "4", "--frames", "4", "--size", "16")
    lines = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert f"wrote {tmp_path / 'manifest.jsonl'}" in out and len(lines) == 4
    assert all((tmp_path / e["path"]).stat().st_size > 0 and e["caption"].startswith("a ") for e in lines)


def test_bench_lora_tiny_counts_the_adapters_and_times_both_steps(tmp_path):
    _, results = run_tiny("bench_lora.py", tmp_path)
    one, eight = results["memory"]
    assert one["gpus"] == 1 and eight["gpus"] == 8 and one["lora_gib"] == pytest.approx(8 * eight["lora_gib"])
    assert 0 < one["adapters"] < one["base"] and one["lora_gib"] < one["full_gib"]
    assert results["checkpoint"][0]["lora_bytes"] == 16 * one["adapters"]
    loras = results["distill"][0]  # the student's adapters with an EMA (20 bytes), the critic's without (16)
    assert loras["gpus"] == 8 and loras["loras_gib"] * 8 * 2**30 == pytest.approx(
        2 * one["base"] + 36 * one["adapters"]
    )
    assert results["step"]["full_s"] > 0 and results["step"]["lora_s"] > 0


def test_benchlib_tiny_defaults_give_way_to_given_options(monkeypatch):
    p = benchlib.parser("doc")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", default="big")
    tiny = dict(steps=2, size="small")
    assert vars(benchlib.parse_args(p, [], tiny)) == dict(tiny=False, json=None, steps=10, size="big")
    assert vars(benchlib.parse_args(p, ["--tiny", "--steps", "5"], tiny)) == dict(
        tiny=True, json=None, steps=5, size="small"
    )
    monkeypatch.setenv(benchlib.TINY_ENV, "1")  # the environment's switch, read when the parser is made
    p = benchlib.parser("doc", json_output=False)
    p.add_argument("--steps", type=int, default=10)
    assert vars(benchlib.parse_args(p, [], dict(steps=2))) == dict(tiny=True, steps=2)


def test_benchlib_measure_table_and_json(tmp_path):
    calls, order = [], []
    timing = benchlib.measure(
        lambda: calls.append(1),
        repeats=3,
        warmup=2,
        before=lambda: order.append("b"),
        after=lambda: order.append("a"),
    )
    assert len(calls) == 5 and len(timing.wall) == len(timing.cpu) == 3
    assert order == ["a", "a"] + ["b", "a"] * 3  # `after` follows every call, `before` only the timed ones
    assert 0 <= timing.min <= timing.median and timing.cpu_median >= 0
    assert (
        benchlib.table(["a", "b"], [[1, "x"], [2.5, ""]]) == "| a | b |\n| --- | --- |\n| 1 | x |\n| 2.5 |  |"
    )
    benchlib.write_json(tmp_path / "sub" / "r.json", {"timing": timing, "n": 1})
    written = json.loads((tmp_path / "sub" / "r.json").read_text())
    assert written["n"] == 1 and written["timing"]["wall"] == timing.wall and written["machine"]["device"]


TRAINING_ROWS = ("full", "lora", "lora-latents", "lora-float8-latents", "sample-float8")


def test_card_memory_tiny_accepts_two_card_recipes_at_their_stated_peaks(tmp_path):
    """Two card recipes (a LoRA on one 24 GB card, full fine-tuning on 8 x 80 GB) at the releases' sizes:
    the start-up check accepts each on its simulated card, and its header states the peak counted."""
    out, results = run_tiny("card_memory.py", tmp_path, "--check")
    found = results["recipes"]
    assert set(found) == {"sana-lora-24gb.yaml", "flux2-klein-full-8x80gb.yaml"}
    lora, full = found["sana-lora-24gb.yaml"], found["flux2-klein-full-8x80gb.yaml"]
    assert (lora["gpus"], full["gpus"]) == (1, 8) and not lora["refused"] and not full["refused"]
    assert 0 < lora["peak_gib"] * 1.4 < lora["free_gib"] < 23 and "AdamW" in full["parts"]
    assert "| sana-lora-24gb.yaml | 1 x 24.0 GiB |" in out


@pytest.mark.slow  # 35 s on the meta device: every card recipe at the releases' sizes
def test_every_card_recipe_fits_its_card_at_its_stated_peak(tmp_path):
    """Each configs/cards/*.yaml (a LoRA on one 24 or 48 GB card, full fine-tuning on 8 x 80 GB) is
    accepted by the start-up memory check on its card, leaves room for what the model leaves out, and
    its header states the peaks counted; and a recipe that cannot fit (FLUX.2 dev's full fine-tune) is
    refused."""
    done = run("card_memory.py", "--check", "--json", str(tmp_path / "all.json"), timeout=300)
    found = json.loads((tmp_path / "all.json").read_text())["recipes"]
    recipes = sorted(p.name for p in (ROOT / "configs" / "cards").glob("*.yaml"))
    assert sorted(found) == recipes and len(recipes) >= 26 and "start-up check" in done
    import card_memory

    for name, result in found.items():
        card = {"24gb": 24.0, "48gb": 48.0, "8x80gb": 79.6}[name.rsplit("-", 1)[1].removesuffix(".yaml")]
        assert not result["refused"] and card_memory.leaves_room(result) and result["free_gib"] < card, name
    from configs import load_config

    dev = tmp_path / "dev-full-8x80gb.yaml"
    dev.write_text(f"base: {ROOT / 'configs' / 'flux2-dev.yaml'}\ndata:\n  latents: x\n")
    stand_in = tmp_path / "flux2_dev"
    card_memory.write_stand_in(stand_in, *card_memory.release_parts("flux2_dev", family_release))
    folders = ("model.pretrained", "vae.pretrained", "text_encoder.pretrained")
    cfg = load_config(dev, [f"{k}={stand_in}" for k in folders])
    refused = card_memory.peak_on_card(cfg, "8x80gb")
    assert refused["peak_gib"] > 80 and "does not fit" in refused["refused"]


def family_release(entry):
    import family_memory

    return family_memory.release_parts({entry})[entry]


@pytest.mark.slow  # 12 s: the fast tier keeps every family's own rows; this count is the whole suite's
def test_family_memory_tiny_counts_every_part(tmp_path):
    """Each family's parts counted (the tiny pipelines' here): sampling the same per GPU on 1 and 8,
    training sharded (full: 20 bytes a transformer parameter over the GPUs), LoRA under full; HunyuanVideo
    1.5's four parts (two text encoders) in bf16 to sample, and its training rows; LTX-2's six and its
    training rows."""
    out, results = run_tiny("family_memory.py", tmp_path)
    for family in ("Qwen-Image", "Sana"):
        found = results["families"][family]
        assert len(found["parameters"]) == 3 and all(n > 0 for n in found["parameters"].values())
        one, eight = found["gib_per_gpu"]["1"], found["gib_per_gpu"]["8"]
        assert one["sample"] == eight["sample"] > 0 and one["full"] > eight["full"] > 0
        transformer = next(n for part, n in found["parameters"].items() if "transformer" in part)
        assert (one["full"] - eight["full"]) * 2**30 == pytest.approx(20 * transformer * (1 - 1 / 8))
        assert 0 < found["adapters"] < transformer and one["lora"] < one["full"]
    assert "| Qwen-Image | sampling | Qwen-Image transformer " in out
    hunyuan = results["families"]["HunyuanVideo 1.5"]  # two text encoders
    assert len(hunyuan["parameters"]) == 4 and all(n > 0 for n in hunyuan["parameters"].values())
    one, eight = hunyuan["gib_per_gpu"]["1"], hunyuan["gib_per_gpu"]["8"]
    assert set(one) == {*TRAINING_ROWS, "sample", "sample-pipefusion"} and one["sample"] == eight["sample"]
    assert eight["sample-pipefusion"] < one["sample-pipefusion"] == one["sample"]  # its blocks over the GPUs
    assert one["full"] > eight["full"] > 0 and one["lora-latents"] < one["lora"] < one["full"]
    assert 0 < one["lora-float8-latents"] < one["lora-latents"]  # a byte a base weight, not two
    ltx2 = results["families"]["LTX-2"]  # six parts (connectors, audio VAE, vocoder)
    assert len(ltx2["parameters"]) == 6 and all(n > 0 for n in ltx2["parameters"].values())
    assert set(ltx2["gib_per_gpu"]["1"]) == {*TRAINING_ROWS, "sample"}
    counts = ltx2["parameters"]
    assert ltx2["gib_per_gpu"]["1"]["sample"] * 2**30 == pytest.approx(2 * sum(counts.values()))
    # data.latents frees Gemma alone: the connectors, audio VAE and vocoder stay for the previews
    freed = ltx2["gib_per_gpu"]["1"]["lora"] - ltx2["gib_per_gpu"]["1"]["lora-latents"]
    assert freed * 2**30 == pytest.approx(2 * counts["LTX-2 text_encoder"])
    assert one["sample"] * 2**30 == pytest.approx(2 * sum(hunyuan["parameters"].values()))
