"""scripts/model_scaling.py: its bytes match what the comm layer counted, and its predictions behave."""

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import model_scaling as ms  # noqa: E402

MIB = 2**20


@pytest.mark.parametrize(
    "ulysses, ring, forward_mib, backward_mib",
    [(2, 1, 2.0, 2.0), (1, 2, 2.0, 6.0), (4, 1, 1.5, 1.5), (1, 4, 3.0, 7.0), (2, 2, 2.0, 4.0)],
)
def test_sp_bytes_match_the_comm_counters(ulysses, ring, forward_mib, backward_mib):
    """BENCHMARKS.md (issue 4): bytes each rank sent per attention layer, counted by
    parallel.compute.comm.stats() in scripts/bench_sp.py, N = 4096 tokens, h = 128, float32."""
    recipe = ms.Recipe("bench_sp", 1, 128, 4, 512, 4096, 0, 1)
    b = ms.sp_bytes(recipe, ms.Layout(1, ulysses, ring, False), element=4)
    assert (b["ulysses_fwd"] + b["ring_fwd"]) / MIB == pytest.approx(forward_mib)
    assert (b["ulysses_bwd"] + b["ring_bwd"]) / MIB == pytest.approx(backward_mib)


@pytest.mark.parametrize("recipe", ms.RECIPES, ids=lambda r: r.name)
def test_more_gpus_are_not_slower_per_sample(recipe):
    per_sample = []
    for gpus in (8, 16, 64, 256, 1024):
        best = ms.best(recipe, gpus, efficiency=0.5)
        if best is not None:
            assert 0 < best["mfu"] <= 0.5 + 1e-9  # never above the compute efficiency it was given
            per_sample.append(best["per_sample_s"])
    # Once the step is bound by the gradient collectives, (P-1)/P of the bytes still grows a little with P:
    # allow that (at most 1/8 more), not a real slowdown.
    assert per_sample and all(b <= a * 1.125 for a, b in zip(per_sample, per_sample[1:])), per_sample
    assert per_sample[-1] < per_sample[0] / 4  # and 8 -> 1,024 GPUs does speed up every recipe


def test_impossible_layouts_are_not_predicted():
    wan = next(r for r in ms.RECIPES if r.name.startswith("Wan2.1-1.3B"))
    assert ms.predict(wan, 64, ms.Layout(8, 8, 1, False), 0.5) is None  # 12 heads do not split 8 ways
    assert ms.predict(wan, 64, ms.Layout(4, 2, 4, False), 0.5) is None  # 4 x 2 x 4 is not 64
    assert ms.predict(wan, 64, ms.Layout(64, 1, 1, False), 0.5) is not None


def test_prints_best_layouts_and_anchors(capsys):
    results = ms.main(["--block-efficiency", "0.5", "--gpus", "8", "64"])
    out = capsys.readouterr().out
    assert "efficiency as given" in out and "arXiv:2309.14509" in out and "NeMo" in out
    assert len(results["anchors"]) == 4 and all(a["predicted"] != "none fits" for a in results["anchors"])
