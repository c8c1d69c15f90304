"""The failures users meet every week, injected into tiny runs on this machine, and how each run ends.

    python scripts/bench_failures.py [--only NAME,NAME] [--out runs/bench_failures] [--list]
    python scripts/bench_failures.py --guard-cost [--guard-steps 40]   # the per-step finiteness check
    python scripts/bench_failures.py --tiny [--guard-cost]   # one quick scenario; a 12-step guard cost

Each scenario starts train.py or infer.py (python, torchrun, or two torchrun agents), injects one fault
with TESSERA_FAULT (parallel/lifecycle/faults.py) and records the first `error:` line and the seconds from the
fault to it and until every process was gone, each exit code, and whether `latest` is intact and
finite. results.json and results.md (the table in BENCHMARKS.md, "Failures";
docs/benchmarks_history.md says how each is measured) go to --out; tests/test_failures.py runs the same
scenarios (SCENARIOS) and asserts on them.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import benchlib

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "tiny.yaml"
SILENCE_S = 5  # parallel.heartbeat_timeout_s in these runs
STALL_S = 4  # parallel.stall_timeout_s where a stall is injected
# 4 samples and batch 2 per rank: an epoch is one step of both ranks.
TWO_RANKS = [
    "--config",
    str(TINY),
    "data.synthetic_samples=4",
    "train.batch_size=2",
    "train.checkpoint_every=3",
    f"parallel.heartbeat_timeout_s={SILENCE_S}",
    "parallel.preflight_timeout_s=60",
]
SAMPLING = [
    "--config",
    str(TINY),
    "--random-weights",
    "--steps",
    "8",
    f"parallel.heartbeat_timeout_s={SILENCE_S}",
    "parallel.preflight_timeout_s=60",
]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
WAN_OPTIONS = [
    "model.adaln=single",
    "model.qk_norm_across_heads=true",
    "model.pooled_text=false",
    "model.text_mask=false",
]  # tiny.yaml's DiT with Wan's architecture options


@dataclass
class Scenario:
    name: str
    row: str  # what the user did
    script: str  # train.py or infer.py
    args: list  # after the script; {run} is the run directory, {out} the scenario's folder
    nproc: int = 2  # 1: plain python
    fault: str = ""  # TESSERA_FAULT
    nodes: int = 1  # 2: two torchrun agents (the fault's rank decides which node)
    expect: str = ""  # in the first `error:` line
    code: int | None = None  # every launcher's exit code, when it is known in advance
    bound_s: float = 5.0  # the target for fault -> error line
    env: dict = field(default_factory=dict)
    prepare: str = ""  # a function below that damages something in the scenario's folder first


SCENARIOS = {
    s.name: s
    for s in [
        Scenario(
            "oom-14b-24gib",
            "a full fine-tune of Wan2.1-14B on a 24 GiB host (simulated: TESSERA_HOST_MEMORY_MB), 1 process",
            "train.py",
            [
                "--config",
                str(ROOT / "configs" / "demo.yaml"),
                "run.output_dir={run}",
                "model.size=Wan2.1-14B",
                "train.max_steps=1",
            ],
            nproc=1,
            expect="this recipe does not fit: its modelled peak is",
            code=2,
            bound_s=10.0,
            env={"TESSERA_HOST_MEMORY_MB": str(24 * 1024)},
        ),
        Scenario(
            "nan-lr-1proc",
            "the loss went NaN (train.lr=1e30), 1 process, a DataLoader worker",
            "train.py",
            [
                "--config",
                str(TINY),
                "run.output_dir={run}",
                "train.lr=1e30",
                "train.max_steps=20",
                "train.log_every=10",
                "train.checkpoint_every=5",
                "data.num_workers=1",
            ],
            nproc=1,
            expect="training diverged: the gradient norm was not finite at step",
            code=2,
        ),
        Scenario(
            "nan-1proc",
            "a NaN loss in step 4, 1 process, a DataLoader worker (checkpoint_every=5, log_every=10)",
            "train.py",
            [
                "--config",
                str(TINY),
                "run.output_dir={run}",
                "train.max_steps=20",
                "train.log_every=10",
                "train.checkpoint_every=5",
                "data.num_workers=1",
            ],
            nproc=1,
            fault="nan@0:4",
            expect="training diverged: the gradient norm was not finite at step 4",
            code=2,
        ),
        Scenario(
            "nan-2ranks",
            "a NaN loss on rank 1 in step 4, 2 ranks (checkpoint_every=3, log_every=10)",
            "train.py",
            [
                *TWO_RANKS,
                "run.output_dir={run}",
                "train.max_steps=9",
                "train.log_every=10",
                "data.num_workers=1",
            ],
            fault="nan@1:4",
            expect="training diverged: the gradient norm was not finite at step 4",
            code=2,
        ),
        Scenario(
            "enospc-2ranks",
            "the disk filled during the save of step 6, 2 ranks",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=9", "data.num_workers=1"],
            fault="enospc@1:6",
            expect="no space left on",
            code=2,
        ),
        Scenario(
            "enospc-1proc",
            "the disk filled during the save of step 6, 1 process",
            "train.py",
            ["--config", str(TINY), "run.output_dir={run}", "train.max_steps=9", "data.num_workers=1"],
            nproc=1,
            fault="enospc@0:6",
            expect="no space left on",
            code=2,
        ),
        Scenario(
            "kill-sampling-pipefusion",
            "rank 1 killed in sampling step 3 (PipeFusion, 2 stages)",
            "infer.py",
            [*SAMPLING, "run.output_dir={run}", "--output", "{out}/v.npy", "parallel.pipefusion=2"],
            fault="sample_kill@1:3",
            expect="rank 1 (",
            bound_s=SILENCE_S + 5,
        ),
        Scenario(
            "kill-sampling-dp",
            "rank 1 killed in sampling step 3 (data parallel, 2 prompts)",
            "infer.py",
            [
                *SAMPLING,
                "run.output_dir={run}",
                "--output",
                "{out}/v.npy",
                "--prompt",
                "a red square",
                "a blue circle",
                "parallel.dp=2",
            ],
            fault="sample_kill@1:3",
            expect="rank 1 (",
            bound_s=SILENCE_S + 5,
        ),
        Scenario(
            "hang-sampling",
            "rank 1's main thread hung in sampling step 3, its watchdog alive (PipeFusion)",
            "infer.py",
            [
                *SAMPLING,
                "run.output_dir={run}",
                "--output",
                "{out}/v.npy",
                "parallel.pipefusion=2",
                f"parallel.stall_timeout_s={STALL_S}",
            ],
            fault="sample_hang@1:3",
            expect="rank 1 (",
            bound_s=STALL_S + 5,
        ),
        Scenario(
            "kill-startup",
            "rank 1 killed at start-up (process groups made, before the first step)",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=6"],
            fault="startup_kill@1",
            expect="rank 1 (",
            bound_s=SILENCE_S + 5,
        ),
        Scenario(
            "kill-before-heartbeat",
            "rank 1 killed at start-up before its first heartbeat (no process group yet)",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=6"],
            fault="prestart_kill@1",
            expect="rank 1 never reached start-up",
            bound_s=SILENCE_S + 5,
        ),
        Scenario(
            "kill-forming-group",
            "rank 1 killed while the process group forms (rank 0 inside gloo's connect)",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=6"],
            fault="pginit_kill@1",
            expect="rank 1 (",
            bound_s=SILENCE_S + 5,
        ),
        Scenario(
            "kill-forming-group-2nodes",
            "rank 1 killed while the process group forms, 2 torchrun agents",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=6"],
            nproc=1,
            nodes=2,
            fault="pginit_kill@1",
            expect="rank 1 (",
            bound_s=SILENCE_S + 5,
        ),
        Scenario(
            "store-host-lost",
            "the node hosting the c10d store lost its worker (2 torchrun agents)",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=9"],
            nproc=1,
            nodes=2,
            fault="kill@0:5",
            expect="the rendezvous store at",
            bound_s=SILENCE_S + 5,
            env={"TORCH_CPP_LOG_LEVEL": "ERROR"},  # for torchrun's agents too, as README's launch line says
        ),
        Scenario(
            "truncated-pretrained",
            "model.pretrained holds a truncated safetensors file, 2 ranks",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "model.pretrained={out}/wan", *WAN_OPTIONS],
            expect="is truncated: ",
            code=2,
            prepare="truncated_pretrained",
        ),
        Scenario(
            "damaged-checkpoint",
            "a checkpoint with checksums.json missing and a truncated shard, 2 ranks",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.max_steps=6"],
            expect="__0_0.distcp is truncated",
            code=2,
            prepare="damaged_checkpoint",
        ),
        Scenario(
            "lr-nan",
            "train.lr=nan, 2 ranks",
            "train.py",
            [*TWO_RANKS, "run.output_dir={run}", "train.lr=nan"],
            expect="'train.lr' must be a finite number, got nan",
            code=2,
        ),
    ]
}


def truncated_pretrained(out: Path) -> None:
    """A diffusers Wan folder that fits tests/tiny.yaml's DiT (with WAN_OPTIONS), its last shard cut short."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(
        patch_size=(1, 4, 4),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=3,
        out_channels=3,
        text_dim=32,
        ffn_dim=256,
        num_layers=2,
        rope_max_seq_len=64,
    ).save_pretrained(out / "wan", max_shard_size="20KB")
    last = sorted((out / "wan").glob("*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size - 10)


def damaged_checkpoint(out: Path) -> None:
    """Three steps trained, then the checkpoint's checksums.json lost and a shard cut in half."""
    args = [a.format(run=out / "run", out=out) for a in SCENARIOS["damaged-checkpoint"].args]
    subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args[:-1], "train.max_steps=3", "train.batch_size=4"],
        cwd=ROOT,
        env={**os.environ, **ENV},
        check=True,
        capture_output=True,
        timeout=120,
    )
    step = out / "run" / "checkpoints" / "step_3"
    (step / "checksums.json").unlink()
    os.truncate(step / "__0_0.distcp", (step / "__0_0.distcp").stat().st_size // 2)


class Launch:
    """Commands (one per torchrun agent) whose stderr lines are time-stamped as they arrive. Every
    process they start carries TESSERA_LAUNCH_TAG in its environment, so leftovers can be found."""

    def __init__(self, commands: list[list[str]], env: dict | None = None, stagger_s: float = 0.0):
        self.tag = uuid.uuid4().hex
        self.start = time.monotonic()
        self.lines: list[tuple[float, int, str]] = []  # (seconds since start, command index, line)
        self.procs = []
        for i, cmd in enumerate(commands):
            if i and stagger_s:
                time.sleep(stagger_s)  # node 0 hosts the store (is_host): node 1 then connects at once
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, **ENV, **(env or {}), "TESSERA_LAUNCH_TAG": self.tag},
                )
            )
        self.readers = [
            threading.Thread(target=self._read, args=(i, p), daemon=True) for i, p in enumerate(self.procs)
        ]
        for reader in self.readers:
            reader.start()
        self.ended: float | None = None

    def _read(self, index, proc):
        for line in proc.stderr:
            self.lines.append((time.monotonic() - self.start, index, line.rstrip("\n")))

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes; None for a launcher still running at `timeout` (then every tagged process is
        killed)."""
        deadline = self.start + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        while self.leftovers() and time.monotonic() < deadline:  # workers may outlive their launcher briefly
            time.sleep(0.1)
        self.ended = time.monotonic() - self.start
        if None in codes or self.leftovers():
            self.kill_all()
        for reader in self.readers:
            reader.join(timeout=5)
        return codes

    def leftovers(self) -> list[int]:
        """Live processes (not zombies) that carry this launch's tag."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if f"TESSERA_LAUNCH_TAG={self.tag}".encode() in (entry / "environ").read_bytes():
                    if (entry / "stat").read_text().split(")")[-1].split()[0] != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
        return found

    def kill_all(self) -> None:
        for p in self.procs:
            p.kill()
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def text(self) -> str:
        return "\n".join(line for _, _, line in self.lines)

    def first(self, pattern: str) -> tuple[float, str] | None:
        found = [(t, line) for t, _, line in self.lines if pattern in line]
        return found[0] if found else None


def command(scenario: Scenario, run_dir: Path, out: Path, node: int = 0, port: int = 0) -> list[str]:
    args = [a.format(run=run_dir, out=out) for a in scenario.args]
    script = str(ROOT / scenario.script)
    if scenario.nodes > 1:
        return [*node_launcher(scenario.nodes, node, scenario.nproc, port, scenario.name), script, *args]
    if scenario.nproc == 1:
        return [sys.executable, script, *args]
    return benchlib.torchrun_command(scenario.nproc, script, args)


def node_launcher(nodes: int, node: int, nproc: int, port: int, run_id: str) -> list[str]:
    """torchrun as node `node` of `nodes` on this machine, rendezvous at 127.0.0.1:`port`. Node 0 hosts the
    rendezvous store (is_host: on one machine every agent would take itself for the host, and the one
    that binds first wins) and is group rank 0 (ranks follow the sorted node addresses, then the agents'
    process ids, which a sandbox may hand out in any order), so a fault's rank decides its node."""
    assert nodes <= 9, "127.0.0.10 would sort before 127.0.0.2"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={int(node == 0)}",
        f"--local-addr=127.0.0.{node + 1}",
    ]


def rank_codes(text: str) -> dict[int, int]:
    """{rank: exit code} of the ranks torchrun reports as failed (a rank that exited 0 is not listed)."""
    return {
        int(rank): int(code)
        for rank, code in re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", text)
    }


def latest_state(run_dir: Path) -> dict:
    """{'latest': the step folder `latest` names or None, 'finite': whether every weight in it is finite}."""
    sys.path.insert(0, str(ROOT))
    import torch

    from parallel.checkpoints.checkpoint_files import CheckpointError, find_latest
    from parallel.checkpoints.checkpoint_reading import verify_checkpoint
    from parallel.lifecycle.storage import local_tensors

    try:
        latest = find_latest(run_dir)
    except CheckpointError as e:
        return {"latest": None, "finite": None, "problem": str(e)}
    if latest is None:
        return {"latest": None, "finite": None}
    try:
        verify_checkpoint(latest)
    except CheckpointError as e:  # the damaged-checkpoint scenario's own damage
        return {"latest": str(latest), "finite": None, "problem": str(e)}
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(latest))
    tensors = [t for t in local_tensors(state) if t.is_floating_point()]
    return {
        "latest": str(latest),
        "finite": all(bool(torch.isfinite(t).all()) for t in tensors),
        "tensors": len(tensors),
    }


def run_scenario(scenario: Scenario, out: Path, timeout: float = 150.0) -> dict:
    """Run one scenario in `out` (emptied first) and return what happened."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run_dir = out / "run"
    if scenario.prepare:
        globals()[scenario.prepare](out)
    env = {**scenario.env, "TESSERA_FAULT": scenario.fault} if scenario.fault else scenario.env
    if scenario.nodes > 1:
        port = benchlib.free_port()
        launch = Launch(
            [command(scenario, run_dir, out, node, port) for node in range(scenario.nodes)],
            env,
            stagger_s=1.0,
        )
    else:
        launch = Launch([command(scenario, run_dir, out)], env)
    codes = launch.wait(timeout)
    fault = launch.first("[fault] ")
    error = launch.first("error:")
    start = fault[0] if fault else 0.0
    # tracebacks printed by the launcher that printed the error line (the other node's torchrun reports
    # its own lost worker first, with a traceback of its own)
    agent = next((i for t, i, line in launch.lines if "error:" in line), None)
    traceback_first = [t for t, i, line in launch.lines if "Traceback" in line and i == agent]
    result = {
        "name": scenario.name,
        "row": scenario.row,
        "fault": scenario.fault or None,
        "codes": codes,
        "rank_codes": rank_codes(launch.text()),
        "error_line": error[1] if error else None,
        "fault_to_error_s": round(error[0] - start, 1) if error else None,
        "fault_to_exit_s": round(launch.ended - start, 1),
        "timed_from": "the fault" if fault else "the launch",
        "traceback_before_error": bool(error and traceback_first and traceback_first[0] < error[0]),
        "left_running": launch.leftovers(),
        "cpp_frames": sum(line.startswith("frame #") for _, _, line in launch.lines),  # C++ stack frames
        "bound_s": scenario.bound_s,
        "expect": scenario.expect,
        "stderr_tail": launch.text()[-6000:],
    }
    result.update(
        latest_state(run_dir) if (run_dir / "checkpoints").is_dir() else {"latest": None, "finite": None}
    )
    return result


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        line = (r["error_line"] or "(none)").split("; this")[0]
        line = re.sub(r"\(\S+:\d+\)", "(host:pid)", line)[:150].replace("|", "/")
        state = "finite" if r["finite"] else "damaged (as injected)" if r.get("problem") else "NOT FINITE"
        latest = "none written" if r["latest"] is None else f"{Path(r['latest']).name}, {state}"
        since = "" if r["timed_from"] == "the fault" else " from the launch, start-up included"
        codes = ", ".join(f"rank {k}: {v}" for k, v in sorted(r["rank_codes"].items())) or ", ".join(
            map(str, r["codes"])
        )
        error = f"{r['fault_to_error_s']} s{since} (target {r['bound_s']:g})"
        rows.append([r["row"], f"`{line}`", error, f"{r['fault_to_exit_s']} s{since}", codes, latest])
    header = [
        "what the user did",
        "first line (shortened)",
        "fault -> `error:`",
        "fault -> every process gone",
    ]
    header += ["exit codes (each rank's, as torchrun reports them)", "`latest`"]
    return benchlib.table(header, rows) + "\n"


def guard_cost(out: Path, steps: int = 40) -> dict:
    """What the per-step finiteness check (parallel/lifecycle/divergence.py, NonFiniteGuard.skip, stop mode)
    costs against the demo's step time: the check timed alone over 20,000 calls, the step time from a short
    demo run in this process (the demo recipe, `steps` steps, logged every 10; the first window, which
    holds start-up, is left out)."""
    import timeit

    sys.path.insert(0, str(ROOT))
    import torch

    import train
    from configs import load_config
    from configs.rundir import read_metrics
    from parallel.lifecycle.divergence import NonFiniteGuard
    from parallel.lifecycle.entrypoint import run_entrypoint

    guard = NonFiniteGuard(load_config(None).train, torch.device("cpu"), out, False, False)
    norm = torch.tensor(1.5)
    calls = 20_000
    check_s = timeit.timeit(lambda: guard.skip(7, norm), number=calls) / calls
    run_dir = out / "guard_cost_run"
    code = run_entrypoint(
        train.main,
        [
            "--config",
            str(ROOT / "configs" / "demo.yaml"),
            f"run.output_dir={run_dir}",
            f"train.max_steps={steps}",
            "train.log_every=10",
            "logging.wandb=false",
            f"train.checkpoint_every={steps}",
            "train.resume=none",
            "data.num_workers=0",
        ],
    )
    windows = [m["step_time"] for m in read_metrics(run_dir)][1:]
    step_s = sorted(windows)[len(windows) // 2] if code == 0 and windows else float("nan")
    return {
        "check_us": round(check_s * 1e6, 1),
        "demo_step_ms": round(step_s * 1e3, 1),
        "share_percent": round(100 * check_s / step_s, 4),
    }


def main(argv=None) -> int:
    parser = benchlib.parser(__doc__, json_output=False)  # results.json and results.md go to --out
    parser.add_argument("--out", default="runs/bench_failures")
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--guard-cost",
        action="store_true",
        help="only time the per-step finiteness check against the demo's step time",
    )
    parser.add_argument("--guard-steps", type=int, default=40, help="demo steps for --guard-cost")
    args = benchlib.parse_args(parser, argv, tiny=dict(only="enospc-1proc", guard_steps=12))
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name}: {s.row}")
        return 0
    if args.guard_cost:
        cost = guard_cost(Path(args.out), args.guard_steps)
        print(
            f"finiteness check: {cost['check_us']} us per step; demo step {cost['demo_step_ms']} ms; "
            f"{cost['share_percent']}% of the step (target <= 1%)"
        )
        return 0
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario(s) {', '.join(unknown)}; --list shows them", file=sys.stderr)
        return 2
    out = Path(args.out)
    results = []
    for name in names:
        result = run_scenario(SCENARIOS[name], out / name)
        results.append(result)
        print(
            f"{name}: error after {result['fault_to_error_s']} s, gone after {result['fault_to_exit_s']} s, "
            f"codes {result['codes']}, left running {result['left_running']}: {result['error_line']}",
            flush=True,
        )
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
