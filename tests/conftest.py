import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "tiny.yaml"
sys.path.insert(0, str(ROOT))  # train.py and infer.py live at the root
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
if os.environ.get("PYTEST_XDIST_WORKER"):  # scripts/test.sh runs two workers on a 2-core machine: one
    import torch  # thread each, or their intra-op threads contend (tiny models gain nothing from two)

    torch.set_num_threads(1)


# The families' shared training rows the fast tier (-m "not slow") leaves to the whole suite: it keeps
# every family's loss, sampling and refusal rows, and the two first families' runs (resume, float8, latents,
# buckets, exports), which exercise the same code for the others (the video rows': resume and exports)
WHOLE_SUITE_ROWS = {  # file: [(rows, tests), ...]
    "tests/test_family_training.py": [
        (("z_image", "flux2", "flux2_dev"),
         ("test_a_run_trains_and_resumes", "test_lora_on_a_float8_base", "test_precomputed_latents",
          "test_buckets_by_aspect_ratio", "test_exports_load_in_diffusers", "test_a_distilled_student")),
        # a distilled student in diffusers: Qwen-Image's row covers the path (Wan's is the whole suite's)
        (("sana",), ("test_a_distilled_student",)),
        # the video rows: their loss, a run that resumes and its exports stay fast
        (("dit", "hunyuan_video15"),
         ("test_lora_on_a_float8_base", "test_precomputed_latents", "test_buckets_by_aspect_ratio",
          "test_a_distilled_student")),
    ],
    # FLUX.2 dev's transformer, weights and LoRAs are klein's code: its sampling and refusals stay fast
    "tests/test_families.py": [
        (("flux2_dev",),
         ("test_bf16", "test_single_file", "test_peft_lora", "test_weights_without", "test_parallel_auto",
          "test_family_of")),
        (("z_image",), ("test_loras_in_the_release_names",)),  # FLUX.2's row covers the path
        # every family's random weights take one path: Qwen-Image's row in the fast tier
        (("sana", "z_image", "flux2", "flux2_dev", "dit", "hunyuan_video15", "ltx2"),
         ("test_random_weights",)),
        # the video rows' folder reading, LoRAs and bf16 are their image siblings' code paths: their sampling
        # against the pipeline, first_block and refusals stay fast
        (("dit", "hunyuan_video15", "ltx2"),
         ("test_bf16", "test_single_file", "test_peft_lora", "test_weights_without", "test_parallel_auto",
          "test_family_of")),
    ],
}  # fmt: skip
# rows a test does not apply to, skipped in every tier with the reason
SKIPPED_ROWS = {  # file: [(rows, tests, reason)]
    "tests/test_family_training.py": [
        (("flux2_dev",),
         ("test_a_run_trains_and_resumes", "test_buckets_by_aspect_ratio", "test_eval_demo",
          "test_a_calibrated_step_cache", "test_parallel_auto", "test_sequence_parallel_training"),
         "klein's training code (the flux2 row): dev's differs by the guidance input, which its loss and "
         "exports test"),
        (("flux2_dev",), ("test_a_distilled_student",), "dev's distillation is refused (test_refusals)"),
    ],
}  # fmt: skip
# the files that take longest, first: xdist's --dist loadfile hands files to the workers in collection order,
# so a long file started last would keep one worker busy after the other has finished (test_failures.py
# waits out timeouts: about 11 minutes of one worker on 2 cores)
LONGEST_FIRST = ("test_failures.py", "test_family_training.py", "test_run_takeover.py", "test_families.py",
                 "test_scripts.py", "test_ltx2_training.py", "test_ltx2_pipeline.py", "test_trust_probes.py",
                 "test_e2e.py", "test_qwen_image_edit.py")  # fmt: skip


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(Path(str(item.fspath)).name, len(order)))  # stable: files whole
    for item in items:
        callspec = getattr(item, "callspec", None)
        ids = set(callspec.id.split("-")) if callspec else set()  # the rows' ids: a family, a release
        for rows, tests in WHOLE_SUITE_ROWS.get(item.nodeid.split("::")[0], []):
            if ids & set(rows) and item.originalname.startswith(tests):
                item.add_marker(pytest.mark.slow)
        for rows, tests, reason in SKIPPED_ROWS.get(item.nodeid.split("::")[0], []):
            if ids & set(rows) and item.originalname.startswith(tests):
                item.add_marker(pytest.mark.skip(reason=reason))


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240, env: dict | None = None):
    """Run `torchrun --nproc_per_node nproc script args` from the repo root; a hang fails at `timeout`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


def ranks(nproc: int, script: str, *args: str, timeout: float = 240, env: dict | None = None, **launch_args):
    """`torchrun(...)` for the tests that check what the ranks compute, not torchrun's own behaviour: the
    ranks are forked from a process that has imported torch, transformers and diffusers (tests/ranks.py),
    seconds instead of a fresh interpreter's imports per rank."""
    from tests.ranks import launch

    return launch(nproc, script, *args, timeout=timeout, env=env, **launch_args)


def run_main(module, argv: list[str]) -> int:
    """Run an entry point in this process (saves seconds of imports per run) and return its exit code."""
    from parallel.lifecycle.entrypoint import run_entrypoint

    return run_entrypoint(module.main, argv)


@pytest.fixture
def tiny_args(tmp_path):
    return ["--config", str(TINY), f"run.output_dir={tmp_path / 'run'}"]
