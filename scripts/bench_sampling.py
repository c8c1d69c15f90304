"""Sampling across processes: bytes and weights per rank, PipeFusion's quality, and a latency model.

    python scripts/bench_sampling.py [--checkpoint RUN_DIR] [--parts bytes quality model] [--json out.json]
    python scripts/bench_sampling.py --tiny     # bytes on 2 processes (the layouts that fit), the model

- bytes: every sampling layout on the demo DiT pinned at 2 x 4 x 4 patches (256 tokens, random
  weights): bytes each rank sends per step (parallel/compute/comm.py) against theory; weights each rank holds;
- quality: PipeFusion against the serial sampler on a trained demo run (--checkpoint; the run's own
  config.yaml is the recipe): PSNR and relative error for warm-up 0-4 and M = 2, 4, 8;
- model: time per denoising step of every layout on 8 GPUs (PCIe, NVLink; Wan2.1-14B's dims) and
  what parallel.auto picks. Bytes and quality run in one torchrun group of --processes (4), gloo.
Theory, inputs and method: docs/benchmarks_history.md, "Sampling across GPUs".
"""

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS_BYTES = 4
# The bytes part's model: the demo DiT as BENCHMARKS.md measured it (issue 10), 8 x 32 x 32 pixels in
# patches of 2 x 4 x 4 = 256 tokens, DiT-demo (128 wide). Pinned here: the demo recipe has moved on (24 px,
# patch 2 x 3 x 3, DiT-demo-96).
BYTES_RECIPE = ["model.patch_size=[2,4,4]", "model.absolute_positions=false", "model.size=DiT-demo"]
FRAMES, SIZE = 8, 32
LAYOUTS_4 = [  # (name, degrees, patches); dp fills the 4 processes
    ("pipefusion=2, M=2", dict(pipefusion=2), 2),
    ("pipefusion=2, M=4", dict(pipefusion=2), 4),
    ("pipefusion=4, M=4", dict(pipefusion=4), 4),
    ("pipefusion=4, M=8", dict(pipefusion=4), 8),
    ("pipefusion=2 x ulysses=2", dict(pipefusion=2, ulysses=2), 2),
    ("pipefusion=2 x ring=2", dict(pipefusion=2, ring=2), 2),
    ("pipefusion=2 x cfg=2", dict(pipefusion=2, cfg=2), 2),
    ("cfg=2", dict(cfg=2), None),
    ("cfg=2 x ulysses=2", dict(cfg=2, ulysses=2), None),
    ("ulysses=4", dict(ulysses=4), None),
    ("ring=4", dict(ring=4), None),
    ("ulysses=2 x ring=2", dict(ulysses=2, ring=2), None),
]
QUALITY_WARMUPS = (0, 1, 2, 3, 4)
QUALITY_PATCHES = ((2, 2), (2, 4), (4, 4), (4, 8))  # (stages, patches): M = N and 2N for N = 2, 4


# ---------------------------------------------------------------------------------------------------
# The worker (under torchrun).


def _runtime(layout):
    import datetime as dt

    import torch
    import torch.distributed as dist

    from parallel.lifecycle.faults import Faults
    from parallel.lifecycle.runtime import sampling_groups, sequence_groups

    rank, timeout = dist.get_rank(), dt.timedelta(seconds=120)
    sequence = sequence_groups(layout, rank, timeout)
    return SimpleNamespace(
        layout=layout,
        sequence=sequence,
        device=torch.device("cpu"),
        sampling=sampling_groups(layout, rank, timeout, sequence),
        faults=Faults(rank),
        control_group=None,  # the finiteness check's group: random weights are never checked
        bf16=lambda precision: False,
    )


def _sample(cfg, layout, patches, warmup, checkpoint, prompts, steps, guidance, size=(FRAMES, SIZE, SIZE)):
    """infer.py's sampling of the DiT under `layout` (its transformer and walk), as videos and the
    parameters this rank holds."""
    import torch

    from models.families import family_named
    from models.sampler import Sampling, generate_images
    from parallel.build.lora import lora_of
    from parallel.drive.family_sampling import Weights, load_sampling

    cfg.parallel.pipefusion_warmup = warmup
    runtime, family = _runtime(layout), family_named(cfg.model.family)
    record = None if checkpoint is None else lora_of(checkpoint)
    weights = Weights(checkpoint, record, use_ema=True, random=checkpoint is None)
    # what load_sampling reads of infer.py's Request (a texts_first family encodes the prompts from it)
    request = SimpleNamespace(
        cache=None, experts=None, prompts=prompts, negative_prompt="", guidance=guidance
    )
    parts, denoise_with, _ = load_sampling(cfg, runtime, family, request, weights, (), patches or 1)
    sampling = Sampling(prompts, list(range(len(prompts))), size, steps, guidance)
    # each rank decodes the whole batch: the bytes counted are the walk's alone
    videos = generate_images(family, parts, sampling, denoise_with=denoise_with, device=parts.device)
    return torch.from_numpy(videos), sum(p.numel() for p in parts.transformer.parameters())


def worker(args):
    import torch.distributed as dist

    from configs import load_config
    from parallel.compute import comm
    from parallel.compute.layout import ParallelLayout

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"bytes": [], "quality": []}
    if "bytes" in args.parts:
        cfg = load_config(ROOT / "configs" / "demo.yaml", [f"run.output_dir={args.scratch}", *BYTES_RECIPE])
        prompts = ["a red square moving left"]
        total = None
        for name, degrees, patches in LAYOUTS_4:
            others = math.prod(degrees.values())
            if world % others:
                continue  # does not fit this many processes
            layout = ParallelLayout(dp=world // others, **degrees)
            comm.reset_stats()
            _, weights = _sample(cfg, layout, patches, 1, None, prompts, STEPS_BYTES, 7.0)
            if total is None or layout.pipefusion == 1:
                total = weights
            sent = sum(comm.stats()["sent"].values())
            gathered = [None] * world
            dist.all_gather_object(gathered, (sent, weights))
            if rank == 0:
                out["bytes"].append(
                    dict(
                        layout=name,
                        degrees=degrees,
                        patches=patches,
                        sent=[s for s, _ in gathered],
                        weights=[w for _, w in gathered],
                    )
                )
    if "quality" in args.parts and args.checkpoint:
        from parallel.checkpoints.checkpoint_files import find_checkpoint

        # the recipe the checkpoint was trained with (the run's own config.yaml), at its preview size
        recipe = Path(args.checkpoint) / "config.yaml"
        if not recipe.is_file():
            recipe = ROOT / "configs" / "demo.yaml"
        cfg = load_config(recipe, [f"run.output_dir={args.checkpoint}"])
        checkpoint = find_checkpoint(cfg, None, False)
        prompts, steps, guidance = list(cfg.sample.prompts), cfg.sample.steps, cfg.sample.guidance
        size = (cfg.data.frames, cfg.data.height, cfg.data.width)
        serial, _ = _sample(
            cfg, ParallelLayout(dp=world), None, 1, checkpoint, prompts, steps, guidance, size
        )
        for stages, patches in (q for q in QUALITY_PATCHES if world % q[0] == 0):
            for warmup in QUALITY_WARMUPS:
                layout = ParallelLayout(dp=world // stages, pipefusion=stages)
                videos, _ = _sample(cfg, layout, patches, warmup, checkpoint, prompts, steps, guidance, size)
                mse = (videos.double() - serial.double()).pow(2).mean().item()
                relative = ((videos.double() - serial.double()).norm() / serial.double().norm()).item()
                if rank == 0:
                    out["quality"].append(
                        dict(
                            stages=stages,
                            patches=patches,
                            warmup=warmup,
                            steps=steps,
                            psnr=10 * math.log10(1 / mse) if mse > 0 else float("inf"),
                            relative_error=relative,
                            max_abs=(videos - serial).abs().max().item(),
                        )
                    )
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# Theory of the bytes part.


def theory_sent(
    degrees, patches, stage, sp_rank, steps, warmup, tokens, grid, hidden, depth, cp, guided=True, element=4
):
    """Bytes one rank sends in a sampling run, per the formulas in docs/benchmarks_history.md
    ("Sampling across GPUs")."""
    from parallel.compute.pipefusion_plan import (
        MessagePlan,
        local_share,
        patch_ranges,
        schedule,
        stage_blocks,
    )

    cfg, pf = degrees.get("cfg", 1), degrees.get("pipefusion", 1)
    u, r = degrees.get("ulysses", 1), degrees.get("ring", 1)
    sp = u * r
    b = 2 if guided and cfg == 1 else 1
    if pf == 1:
        n = -(-tokens // sp)
        per_step = (
            depth * (4 * b * n * hidden * (u - 1) / u + 2 * b * n * hidden * (r - 1))
            + (sp - 1) * b * n * hidden
        )
        per_step += (cfg - 1) * tokens * cp  # the velocity all-gather
        return steps * per_step * element
    layers = len(stage_blocks(depth, pf)[stage])
    plan_bytes = 8 * len(MessagePlan.__dataclass_fields__)  # int64 fields
    total = (pf - 1) * (plan_bytes + 32) + 2 * (
        pf - 1
    ) / pf * 4  # plan and count all-gathers, the return group's start
    for item in schedule(steps, warmup, patch_ranges(grid, patches), tokens):
        n = local_share(item, sp, sp_rank)[1]
        total += layers * (4 * b * n * hidden * (u - 1) / u + 2 * b * n * hidden * (r - 1)) * element
        if stage < pf - 1:
            total += b * n * hidden * element
        else:
            total += (cfg - 1) * n * cp * element + (sp - 1) * n * cp * element
            if item.step < steps - 1:
                total += (item.end - item.start) * cp * 4
    return total


def bytes_table(results):
    from configs import load_config
    from models.dit.transformer import size_of

    cfg = load_config(ROOT / "configs" / "demo.yaml", BYTES_RECIPE)
    size = size_of(cfg.model)
    pt, ph, pw = cfg.model.patch_size
    grid = (FRAMES // pt, SIZE // ph, SIZE // pw)
    tokens, cp = math.prod(grid), 3 * pt * ph * pw
    rows = []
    whole = max(max(entry["weights"]) for entry in results)
    for entry in results:
        degrees, patches = entry["degrees"], entry["patches"]
        world = len(entry["sent"])
        others = math.prod(degrees.values())
        stride = world // (world // others)  # ranks per replica
        theory = []
        for rank in range(world):
            local = rank % stride
            u, r = degrees.get("ulysses", 1), degrees.get("ring", 1)
            pf = degrees.get("pipefusion", 1)
            sp_rank = local % (u * r)
            stage = (local // (u * r)) % pf
            theory.append(
                theory_sent(
                    degrees,
                    patches or 1,
                    stage,
                    sp_rank,
                    STEPS_BYTES,
                    1,
                    tokens,
                    grid,
                    size["hidden_size"],
                    size["depth"],
                    cp,
                )
            )
        measured = [s / STEPS_BYTES for s in entry["sent"]]
        theory = [t / STEPS_BYTES for t in theory]
        ratio = [
            m / t if t else (1.0 if m == 0 else float("inf")) for m, t in zip(measured, theory, strict=True)
        ]
        entry["theory"], entry["measured_over_theory"] = theory, ratio  # for --json
        share = sorted({f"{w / whole:.2f}" for w in entry["weights"]})
        rows.append(
            [entry["layout"], " / ".join(f"{m / 1024:.1f}" for m in measured) + " KiB"]
            + [" / ".join(f"{t / 1024:.1f}" for t in theory) + " KiB", f"{min(ratio):.3f}-{max(ratio):.3f}"]
            + [", ".join(share)]
        )
    header = ["layout", "bytes sent per rank per step: measured (per rank)", "theory", "measured / theory"]
    return benchlib.table(header + ["weights per rank (share of the whole DiT)"], rows)


def quality_table(results):
    rows = [
        [q["stages"], q["patches"], f"{q['warmup']} of {q['steps']}", f"{q['psnr']:.1f}"]
        + [f"{q['relative_error']:.2e}", f"{q['max_abs']:.2e}"]
        for q in results
    ]
    header = ["stages N", "patches M", "warm-up", "PSNR vs serial (dB)", "relative error", "max abs"]
    return benchlib.table(header, rows)


# ---------------------------------------------------------------------------------------------------
# The latency model.

# The H100's measured forward throughput: sample_dit (models/dit/family.py) at Wan2.1-1.3B dims, 14,040
# tokens, guidance 5 (batch 2), 443 ms per Euler step (BENCHMARKS.md, issue 12, scripts/bench_gpu.py).
H100_STEP_S, H100_STEP_CASE = 0.443, dict(depth=30, hidden=1536, ffn=8960, tokens=14_040, batch=2)
PEAK = {"H100": 989e12, "L40": 181e12}  # dense bf16, vendor figures
LINK = {"NVLink (H100-class)": ("H100", 450e9, 20e-6), "PCIe (L40-class)": ("L40", 25e9, 30e-6)}
WAN14B = dict(depth=40, hidden=5120, heads=40, ffn=13_824, in_channels=16, text=512)
CASES = {
    "1024 x 1024 image": 64 * 64,
    "720p x 81 frames": 21 * 45 * 80,
}  # tokens: latent / 8, patch 1 x 2 x 2
SAMPLING_STEPS, WARMUP = 50, 1


def forward_flops(depth, hidden, ffn, tokens, batch=1, text=512):
    from bench_gpu import dit_flops

    return dit_flops(depth, hidden, ffn, tokens, text, batch, 16, 4096)


def measured_efficiency():
    """The fraction of the H100's peak that tessera's sampler reached (forward, bf16)."""
    c = H100_STEP_CASE
    return (
        forward_flops(c["depth"], c["hidden"], c["ffn"], c["tokens"], c["batch"]) / H100_STEP_S / PEAK["H100"]
    )


def step_time(
    degrees, tokens, gpu, bandwidth, latency, efficiency, patches=None, steps=SAMPLING_STEPS, warmup=WARMUP
):
    """(seconds per denoising step averaged over the run, of which exposed communication), guidance on
    (both branches). Compute divides perfectly over the ranks that share a sample; a layer's attention
    share is counted from its FLOPs. Ulysses' all-to-alls are exposed; ring's transfers hide behind the
    layer's attention and PipeFusion's sends behind the next patch's compute (only the excess is
    exposed); PipeFusion pays its pipeline fill ((N - 1) patch times per run) and runs the warm-up steps
    through the stages one after another."""
    m = WAN14B
    D, L, element = m["hidden"], m["depth"], 2
    cfg, pf = degrees.get("cfg", 1), degrees.get("pipefusion", 1)
    u, r = degrees.get("ulysses", 1), degrees.get("ring", 1)
    sp = u * r
    b = 2 // cfg  # samples per forward on a rank: both branches unless cfg=2 splits them
    flops = forward_flops(L, D, m["ffn"], tokens, b)
    layer = flops / L / (PEAK[gpu] * efficiency)  # one layer over the whole sequence on one rank
    attention_share = (4 * tokens * tokens * D) / (flops / b / L)

    def layer_comm(item_tokens):
        """(exposed, total) seconds of one layer's sequence-parallel traffic, for an item of this many
        tokens."""
        n = item_tokens / sp
        ulysses = (4 * b * n * D * (u - 1) / u * element / bandwidth + 2 * latency) if u > 1 else 0.0
        ring = (2 * b * n * D * (r - 1) * element / bandwidth + (r - 1) * latency) if r > 1 else 0.0
        hidden_behind = attention_share * layer * (item_tokens / tokens) / sp
        return ulysses + max(0.0, ring - hidden_behind), ulysses + ring

    cfg_gather = (
        (tokens * 64 * element / bandwidth + latency) if cfg > 1 else 0.0
    )  # the velocity, Cp = 16 x 4
    if pf == 1:
        gather = ((sp - 1) * b * tokens / sp * D * element / bandwidth + latency) if sp > 1 else 0.0
        comm = L * layer_comm(tokens)[0] + gather + cfg_gather
        return L * layer / sp + comm, comm
    patches = patches or pf
    layers = L / pf
    patch_compute = layers * layer / sp / patches  # one patch through one stage
    send = b * tokens / sp / patches * D * element / bandwidth + latency
    per_patch_comm = (
        layers * layer_comm(tokens / patches)[0] + max(0.0, send - patch_compute) + cfg_gather / patches
    )
    items = (steps - warmup) * patches + pf - 1  # the pipeline fills once after the warm-up
    compute = items * patch_compute + warmup * pf * patches * patch_compute
    comm = items * per_patch_comm + warmup * pf * (
        layers * layer_comm(tokens)[1] + send * patches + cfg_gather
    )
    return (compute + comm) / steps, comm / steps


MEMORY = {"H100": 80e9, "L40": 48e9}


def memory_per_gpu(degrees, tokens):
    """Bytes a rank holds that the layout decides: the bf16 weights of its blocks (1/N under PipeFusion) and
    PipeFusion's K/V buffers (every layer of the stage, the whole sequence, its heads: ring does not divide
    them). Activations of one layer at a time are left out (a few x tokens/sp x hidden)."""
    from models.dit.transformer import DiT_models

    m = WAN14B
    cfg, pf, u = degrees.get("cfg", 1), degrees.get("pipefusion", 1), degrees.get("ulysses", 1)
    b = 2 // cfg
    weights = 14.29e9 * 2 / pf if DiT_models["Wan2.1-14B"]["depth"] == m["depth"] else None
    kv = (m["depth"] / pf) * 2 * b * tokens * m["hidden"] / u * 2 if pf > 1 else 0.0
    return weights + kv


def model_tables(world=8):
    from parallel.compute.layout import auto_layout, valid_layouts

    efficiency = measured_efficiency()
    lines = [
        f"Inputs: forward efficiency {efficiency:.1%} of peak (measured on the H100, see above), "
        f"Wan2.1-14B dims (40 layers, 5120 wide, 40 heads), guidance on, {SAMPLING_STEPS} steps, "
        f"warm-up {WARMUP}, M = N patches; peaks H100 989, L40 181 TFLOP/s; the L40 is assumed to reach the "
        "same fraction."
    ]
    verdicts = {}
    for link, (gpu, bandwidth, latency) in LINK.items():
        for case, tokens in CASES.items():
            single = (
                step_time({}, tokens, gpu, bandwidth, latency, efficiency)[0] * 1
            )  # one GPU: both branches
            options = []
            for layout in valid_layouts(world, WAN14B["heads"], "sample", WAN14B["depth"], True):
                if layout.dp != 1:
                    continue
                degrees = {
                    k: getattr(layout, k)
                    for k in ("cfg", "pipefusion", "ulysses", "ring")
                    if getattr(layout, k) > 1
                }
                if memory_per_gpu(degrees, tokens) > 0.9 * MEMORY[gpu]:
                    continue  # does not fit beside activations and the VAE
                total, comm = step_time(degrees, tokens, gpu, bandwidth, latency, efficiency)
                options.append((total, comm, layout))
            options.sort(key=lambda o: o[0])
            auto = auto_layout(
                world,
                WAN14B["heads"],
                world,
                mode="sample",
                depth=WAN14B["depth"],
                guided=True,
                slow_links=gpu == "L40",
                tokens=tokens,
            )
            auto_fits = memory_per_gpu(
                {k: getattr(auto, k) for k in ("cfg", "pipefusion", "ulysses", "ring")}, tokens
            )
            auto_time = step_time(
                {k: getattr(auto, k) for k in ("cfg", "pipefusion", "ulysses", "ring")},
                tokens,
                gpu,
                bandwidth,
                latency,
                efficiency,
            )[0]

            def row(name, degrees, total, comm, tokens=tokens, single=single):
                gb = f"{memory_per_gpu(degrees, tokens) / 1e9:.0f}"
                return [name, f"{total:.4f}", f"{comm:.4f}", f"{single / total:.2f}x", gb]

            rows = [
                row(
                    f"{layout.cfg}, {layout.pipefusion}, {layout.ulysses}, {layout.ring}",
                    {k: getattr(layout, k) for k in ("cfg", "pipefusion", "ulysses", "ring")},
                    total,
                    comm,
                )
                for total, comm, layout in options[:6]
            ]
            for name, degrees in (
                ("ulysses=8", dict(ulysses=8)),
                ("ring=8", dict(ring=8)),
                ("pipefusion=8", dict(pipefusion=8)),
            ):
                rows.append(
                    row(name, degrees, *step_time(degrees, tokens, gpu, bandwidth, latency, efficiency))
                )
            fits = "" if auto_fits <= 0.9 * MEMORY[gpu] else " **does not fit**"
            rows.append(
                [
                    f"parallel.auto: {auto.cfg}, {auto.pipefusion}, {auto.ulysses}, {auto.ring}",
                    f"{auto_time:.4f}",
                ]
                + ["", f"{single / auto_time:.2f}x (best that fits: {single / options[0][0]:.2f}x)"]
                + [f"{auto_fits / 1e9:.0f}{fits}"]
            )
            header = [
                "layout (cfg, pipefusion, ulysses, ring)",
                "s per step",
                "of which exposed communication",
            ]
            header += ["speed-up", "GB per GPU (weights + K/V)"]
            lines += ["", f"**{case}, 8 x {gpu}, {link}** (one GPU: {single:.3f} s per step)", ""]
            lines.append(benchlib.table(header, rows))
            verdicts[(link, case)] = (
                options[0][2],
                auto,
                auto_time / options[0][0],
                auto_fits <= 0.9 * MEMORY[gpu],
            )
    return lines, verdicts


def weights_table(sizes=("Wan2.1-1.3B", "Wan2.1-14B"), stages=(2, 4, 8)):
    """Parameters each PipeFusion stage holds, counted on the meta device (nothing allocated)."""
    import torch
    from omegaconf import OmegaConf

    from configs.schema import ModelConfig
    from models.dit.transformer import build_dit
    from parallel.compute.pipefusion_plan import keep_blocks

    rows = []
    for size in sizes:
        with torch.device("meta"):
            model = build_dit(
                OmegaConf.merge(
                    OmegaConf.structured(ModelConfig),
                    dict(
                        size=size,
                        patch_size=[1, 2, 2],
                        mlp_ratio=4.0,
                        qk_norm=True,
                        attention_backend="sdpa",
                        rope_theta=10000.0,
                    ),
                ),
                in_channels=16,
                text_dim=4096,
            )
        whole = sum(p.numel() for p in model.parameters())
        for n in stages:
            largest = max(sum(p.numel() for p in keep_blocks(model, s, n).parameters()) for s in range(n))
            share = f"{largest / 1e9:.3f}B, {largest / whole:.3f} (1/N = {1 / n:.3f})"
            rows.append([f"{size} ({whole / 1e9:.2f}B)", n, share])
    return benchlib.table(["model", "pipefusion", "parameters per stage (largest), share of the whole"], rows)


def main(argv=None):
    p = benchlib.parser(__doc__)
    p.add_argument(
        "--parts", nargs="+", default=["bytes", "quality", "model"], choices=["bytes", "quality", "model"]
    )
    p.add_argument("--checkpoint", default=None, help="a run directory of configs/demo.yaml (quality)")
    p.add_argument("--processes", type=int, default=4, help="of the bytes and quality parts' group")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--scratch", default="/tmp/tessera_bench_sampling", help=argparse.SUPPRESS)
    args = benchlib.parse_args(p, argv, tiny=dict(parts=["bytes", "model"], processes=2))
    if args.worker:
        return worker(args)
    report, results = [], {}
    if {"bytes", "quality"} & set(args.parts) and (
        "quality" not in args.parts or args.checkpoint or "bytes" in args.parts
    ):
        out = Path(args.scratch) / "worker.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        worker_args = [
            "--worker",
            "--worker-out",
            str(out),
            "--scratch",
            args.scratch,
            "--parts",
            *args.parts,
        ]
        if args.checkpoint:
            worker_args += ["--checkpoint", args.checkpoint]
        benchlib.torchrun(args.processes, __file__, worker_args)
        results = json.loads(out.read_text())
        if results["bytes"]:
            title = f"### Bytes and weights per rank ({args.processes} processes, gloo)"
            report += [title, "", bytes_table(results["bytes"]), ""]
        if results["quality"]:
            title = "### PipeFusion against the serial sampler (trained demo checkpoint)"
            report += [title, "", quality_table(results["quality"]), ""]
    if "model" in args.parts:
        lines, verdicts = model_tables()
        report += [
            "### Weights per rank under PipeFusion (meta device)",
            "",
            weights_table(),
            "",
            "### Latency model, 8 GPUs",
            "",
            *lines,
            "",
        ]
        results["model"] = {
            f"{k[0]} / {k[1]}": dict(
                best=v[0].describe(), auto=v[1].describe(), auto_over_best=v[2], auto_fits=v[3]
            )
            for k, v in verdicts.items()
        }
    print("\n".join(report))
    if args.json:
        benchlib.write_json(args.json, results)


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    leave_finished(main())
