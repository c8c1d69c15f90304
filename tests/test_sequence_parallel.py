"""Sequence-parallel attention against single-process attention, under torchrun (gloo, CPU).

The checks themselves live in tests/sp_worker.py: one launch per process count runs every layout
and token count, because each process pays seconds of imports.
"""

import pytest

from tests.conftest import torchrun

FOUR_PROCESS_LAYOUTS = ["u4r1", "u1r4", "u2r2", "u2r1", "u1r2"]


def _passed(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [line for line in result.stdout.splitlines() if line.startswith("ok ")]


@pytest.mark.timeout(180)
def test_four_processes_ulysses_ring_and_hybrid():
    passed = _passed(torchrun(4, "tests/sp_worker.py", timeout=150))
    for layout in FOUR_PROCESS_LAYOUTS:
        p = 4 if layout in ("u4r1", "u1r4", "u2r2") else 2
        for tokens in (6 * p, 6 * p - 1, p + 1):
            for part in ("forward", "dq", "dk", "dv"):
                assert any(line.startswith(f"ok attention {layout} N={tokens} {part} ") for line in passed), \
                    (layout, tokens, part)
        assert sum(line.startswith(f"ok DiT {layout} ") for line in passed) == 4, layout
    assert "ok chunked collectives identical" in passed


@pytest.mark.timeout(180)
def test_three_process_ring():
    passed = _passed(torchrun(3, "tests/sp_worker.py", timeout=150))
    assert sum(line.startswith("ok attention u1r3 ") for line in passed) == 12
    assert sum(line.startswith("ok DiT u1r3 ") for line in passed) == 4
