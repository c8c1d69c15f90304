"""A scaling model for training: time per step and MFU of a recipe under a layout on 8-1,024 GPUs.

    python scripts/model_scaling.py [--gpus 8 64 256 1024] [--block-efficiency 0.55] [--json out.json]
    python scripts/model_scaling.py --tiny     # the CPU probe on a 64-wide block, 8 and 64 GPUs: seconds

It models compute (a block's FLOPs at the GPU's bf16 peak times an efficiency: --block-efficiency, or,
unset, one block timed on this CPU and scaled by the peak ratio, labelled [CPU-scaled]), the bytes of
Ulysses, Ring and FSDP2 (the formulas bench_sp.py checked), stated link speeds, overlap and memory (80
GB per GPU). It prints the best layout per recipe and GPU count (shortest time per sample) and published
anchors beside its own prediction for a comparable case. Inputs and limits: docs/benchmarks_history.md,
"Training across GPUs (a model)".
"""

import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

GPU = {"H100": dict(peak=989e12, memory=80e9), "A100": dict(peak=312e12, memory=80e9)}
LINKS = {"nvlink": 450e9, "pcie": 25e9}
IB = 400e9 / 8  # 400 Gb/s per GPU
NODE = 8
LATENCY_NODE, LATENCY_IB = 20e-6, 50e-6
BF16, FP32 = 2, 4
# The CPU probe's block: DiT-XL's (width, heads, MLP width); --tiny probes a 64-wide one
PROBE, TINY_PROBE = (1152, 16, 4608), (64, 4, 256)


@dataclass
class Recipe:
    name: str
    depth: int
    hidden: int
    heads: int
    ffn: int
    tokens: int  # per sample
    text_tokens: int
    global_batch: int  # samples per optimizer step
    in_channels: int = 16
    text_dim: int = 4096

    @property
    def params(self) -> float:
        D, F = self.hidden, self.ffn
        per_block = (
            3 * D * D + D * D + D * D + 2 * D * D + D * D + 2 * D * F + 6 * D * D
        )  # attn, cross, MLP, adaLN
        return self.depth * per_block + self.text_dim * D + D * D


RECIPES = [
    Recipe("DiT-XL 256px", 28, 1152, 16, 4608, 256, 120, 1024, in_channels=4),
    Recipe("Wan2.1-1.3B dims, 33x480x832", 30, 1536, 12, 8960, 14_040, 512, 256),
    Recipe("DiT-2B, 33x480x832", 28, 2048, 16, 8192, 14_040, 512, 256),
    Recipe("Wan2.1-14B dims, 37k tokens", 40, 5120, 40, 13_824, 37_440, 512, 128),
    Recipe("DiT-5B, 208k tokens", 32, 3072, 24, 12_288, 208_000, 512, 32),
]


@dataclass
class Layout:
    dp: int
    ulysses: int
    ring: int
    ac: bool
    hsdp: bool = False  # shard within a node, replicate across nodes (not in tessera yet)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    def describe(self) -> str:
        return (
            f"dp={self.dp} ulysses={self.ulysses} ring={self.ring}{' +AC' if self.ac else ''}"
            f"{' HSDP*' if self.hsdp else ''}"
        )


def block_flops(r: Recipe, tokens: int) -> float:
    """Forward FLOPs of one block for one sample of `tokens` tokens (bench_gpu's formula, one block)."""
    from bench_gpu import dit_flops

    return dit_flops(1, r.hidden, r.ffn, tokens, r.text_tokens, 1, r.in_channels, r.text_dim) - dit_flops(
        0, r.hidden, r.ffn, tokens, r.text_tokens, 1, r.in_channels, r.text_dim
    )


def attention_flops(r: Recipe, tokens: int) -> float:
    return 2 * 2 * tokens * tokens * r.hidden


def model_flops(r: Recipe) -> float:
    """Training FLOPs of one sample, by the one formula (bench_gpu.dit_flops: 3 x the linear layers,
    3.5 x attention)."""
    from bench_gpu import dit_flops

    return dit_flops(
        r.depth, r.hidden, r.ffn, r.tokens, r.text_tokens, 1, r.in_channels, r.text_dim, train=True
    )


def measure_cpu_efficiency(hidden: int, heads: int, ffn: int, tokens: int = 256, repeats: int = 3) -> dict:
    """One DiT block, forward + backward in float32 on this CPU: achieved FLOP/s over the CPU's estimated
    peak."""
    import torch
    from bench_gpu import device_info

    from models.dit.transformer import DiTBlock, RotaryEmbedding3D

    torch.manual_seed(0)
    block = DiTBlock(hidden, heads, ffn, True, "sdpa")  # mlp_hidden is a width, not a ratio
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    c, y, y_mask = torch.randn(1, hidden), torch.randn(1, 16, hidden), torch.ones(1, 16, dtype=torch.bool)
    rope = RotaryEmbedding3D(hidden // heads)((1, 16, tokens // 16), "cpu")
    seconds = benchlib.measure(lambda: block(x, c, y, y_mask, rope).sum().backward(), repeats).median
    r = Recipe("probe", 1, hidden, heads, ffn, tokens, 16, 1, text_dim=hidden)
    flops = 3 * block_flops(r, tokens)
    peak = device_info(torch.device("cpu"))["peak_tflops"] * 1e12
    return dict(
        seconds=seconds,
        tflops=flops / seconds / 1e12,
        cpu_peak_tflops=peak / 1e12,
        efficiency=min(1.0, flops / seconds / peak),
        hidden=hidden,
        tokens=tokens,
    )


def link_bandwidth(span: int, link: str) -> tuple[float, float]:
    """(bytes/s per GPU, latency) of a group whose ranks lie within `span` consecutive GPUs."""
    return (LINKS[link], LATENCY_NODE) if span <= NODE else (IB, LATENCY_IB)


def sp_bytes(r: Recipe, layout: Layout, element: int = BF16) -> dict:
    """Bytes this rank sends per attention layer, forward and backward (the comm-counter formulas)."""
    u, ring, D = layout.ulysses, layout.ring, r.hidden
    n = math.ceil(r.tokens / layout.sp)  # this rank's tokens
    ulysses = 4 * n * D * (u - 1) / u * element
    # after Ulysses a rank holds N / ring tokens of D / u channels
    kv = 2 * math.ceil(r.tokens / ring) * (D // u) * element
    kv_fp32 = 2 * math.ceil(r.tokens / ring) * (D // u) * FP32
    ring_fwd = kv * (ring - 1)
    ring_bwd = kv * (ring - 1) + (kv_fp32 * ring if ring > 1 else 0)
    return dict(ulysses_fwd=ulysses, ulysses_bwd=ulysses, ring_fwd=ring_fwd, ring_bwd=ring_bwd)


def predict(
    r: Recipe, gpus: int, layout: Layout, efficiency: float, gpu: str = "H100", link: str = "nvlink"
) -> dict | None:
    peak, memory = GPU[gpu]["peak"], GPU[gpu]["memory"]
    if layout.dp * layout.sp != gpus or r.heads % layout.ulysses or layout.ulysses > NODE:
        return None
    if r.global_batch % layout.dp:
        return None
    samples = r.global_batch // layout.dp  # per sequence-parallel group, one after another
    n = math.ceil(r.tokens / layout.sp)
    # memory per GPU
    shard = min(gpus, NODE) if layout.hsdp else gpus  # ranks one copy of the weights is sharded over
    states = 16 * r.params / shard
    activations = (
        (2 * n * r.hidden * r.depth + 40 * n * r.hidden) if layout.ac else 40 * n * r.hidden * r.depth
    )
    if states + activations * BF16 / 2 > 0.9 * memory:
        return None
    # compute per sample on this rank: its share of every block
    flops_block = block_flops(r, r.tokens) / layout.sp
    compute_block = 3 * flops_block / (peak * efficiency) * (4 / 3 if layout.ac else 1)
    attention_block = 3 * attention_flops(r, r.tokens) / layout.sp / (peak * efficiency)
    # sequence parallel comm per block
    b = sp_bytes(r, layout)
    u_bw, u_lat = link_bandwidth(layout.ulysses, link)
    r_bw, r_lat = link_bandwidth(layout.sp, link)
    ulysses_time = ((b["ulysses_fwd"] + b["ulysses_bwd"]) / u_bw + 4 * u_lat) if layout.ulysses > 1 else 0.0
    ring_time = (
        ((b["ring_fwd"] + b["ring_bwd"]) / r_bw + 3 * (layout.ring - 1) * r_lat) if layout.ring > 1 else 0.0
    )
    exposed_block = ulysses_time + max(0.0, ring_time - attention_block)
    outside_blocks = (
        (model_flops(r) - 3 * r.depth * block_flops(r, r.tokens)) / layout.sp / (peak * efficiency)
    )
    per_sample = r.depth * (compute_block + exposed_block) + outside_blocks  # + embedders and final layer
    compute = samples * per_sample
    # FSDP over the shard group, once per step: bf16 all-gather x 2 + float32 reduce-scatter; with
    # HSDP, then an all-reduce of this rank's float32 gradient shard across the node replicas (IB)
    f_bw, f_lat = link_bandwidth(shard, link)
    fsdp_time = r.params * (2 * BF16 + FP32) * (shard - 1) / shard / f_bw + 3 * r.depth * f_lat
    replicas = gpus // shard
    if replicas > 1:
        fsdp_time += 2 * (replicas - 1) / replicas * r.params / shard * FP32 / IB + r.depth * LATENCY_IB
    step = max(compute, fsdp_time)
    mfu = model_flops(r) * r.global_batch / (step * gpus * peak)
    return dict(
        recipe=r.name,
        gpus=gpus,
        layout=layout.describe(),
        step_s=step,
        per_sample_s=step / r.global_batch,
        mfu=mfu,
        compute_s=compute,
        fsdp_s=fsdp_time,
        exposed_sp_s=samples * r.depth * exposed_block,
        memory_gb=(states + activations * BF16 / 2) / 1e9,
        sp_bytes_per_block=b,
    )


def layouts(gpus: int):
    for ulysses, ring in itertools.product([1, 2, 4, 8], [1, 2, 4, 8, 16, 32]):
        if gpus % (ulysses * ring) == 0:
            for ac, hsdp in itertools.product((False, True), (False, True) if gpus > NODE else (False,)):
                yield Layout(gpus // (ulysses * ring), ulysses, ring, ac, hsdp)


def best(r: Recipe, gpus: int, efficiency: float, gpu="H100", link="nvlink") -> dict | None:
    rows = [p for lay in layouts(gpus) if (p := predict(r, gpus, lay, efficiency, gpu, link))]
    return min(rows, key=lambda p: p["step_s"]) if rows else None


ANCHORS = [
    dict(
        what="torchtitan, Llama 3.1 8B, 8 x H100, FSDP + compile + float8 off, seq 8k",
        mfu="33-39%",
        source="torchtitan, arXiv:2410.06511 and docs/performance.md",
        compare=("Wan2.1-1.3B dims, 33x480x832", 8, "H100"),
    ),
    dict(
        what="DeepSpeed-Ulysses, long-sequence GPT on A100s",
        mfu="54% of peak (175 TFLOP/s per A100)",
        source="Jacobs et al., arXiv:2309.14509",
        compare=("DiT-5B, 208k tokens", 64, "A100"),
    ),
    dict(
        what="USP (Ulysses x Ring), Llama-3 8B at 208k tokens, 2 x 8 A800",
        mfu="47%",
        source="Fang & Zhao, arXiv:2405.07719",
        compare=("DiT-5B, 208k tokens", 16, "A100"),
    ),
    dict(
        what="NeMo, Wan2.1 14B at 37k tokens, 128 x H100",
        mfu="326 TFLOP/s per GPU = 33% of 989",
        source="NVIDIA NeMo performance summary (DiT/Wan)",
        compare=("Wan2.1-14B dims, 37k tokens", 128, "H100"),
    ),
]


def main(argv=None):
    p = benchlib.parser(__doc__)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--gpu", choices=list(GPU), default="H100")
    p.add_argument("--link", choices=list(LINKS), default="nvlink", help="the link inside a node")
    p.add_argument(
        "--block-efficiency",
        type=float,
        default=None,
        help="fraction of bf16 peak a block reaches on the GPU (from scripts/bench_gpu.py); "
        "unset: measured on this CPU and scaled by the peak ratio (flagged)",
    )
    p.add_argument("--probe-tokens", type=int, default=256)
    args = benchlib.parse_args(p, argv, tiny=dict(gpus=[8, 64], probe_tokens=64))

    probe = None
    if args.block_efficiency is None:
        hidden, heads, ffn = TINY_PROBE if args.tiny else PROBE
        probe = measure_cpu_efficiency(hidden, heads, ffn, args.probe_tokens)
        efficiency, flag = probe["efficiency"], "CPU-scaled"
        print(
            f"block efficiency: {100 * efficiency:.0f}% of peak, MEASURED ON CPU (one {hidden}-wide block, "
            f"{args.probe_tokens} tokens, {probe['tflops'] * 1e3:.1f} GFLOP/s of an estimated "
            f"{probe['cpu_peak_tflops'] * 1e3:.0f}) and assumed to carry over to the {args.gpu}: [CPU-scaled]"
        )
    else:
        efficiency, flag = args.block_efficiency, "efficiency as given"
    results = {"efficiency": efficiency, "flag": flag, "probe": probe, "best": [], "anchors": []}
    rows = []
    for r in RECIPES:
        for gpus in args.gpus:
            b = best(r, gpus, efficiency, args.gpu, args.link)
            if b is None:
                rows.append([r.name, gpus, "none fits", "", "", "", "", "", ""])
                continue
            results["best"].append(b)
            rows.append(
                [r.name, gpus, b["layout"], f"{b['step_s']:.3f}", f"{b['per_sample_s'] * 1e3:.2f} ms"]
                + [f"{100 * b['mfu']:.0f}%", f"{b['exposed_sp_s']:.3f}", f"{b['fsdp_s']:.3f}"]
                + [f"{b['memory_gb']:.0f}"]
            )
    print(f"\nBest layout per recipe and GPU count [{flag}]:\n")
    header = [
        "recipe",
        "GPUs",
        "best layout",
        "s/step",
        "s/sample",
        "MFU",
        "exposed SP s",
        "FSDP s",
        "GB/GPU",
    ]
    print(benchlib.table(header, rows))
    print(
        "\nPublished anchors next to this model's prediction for a comparable case (not like for like: "
        "the anchors are LLMs or other code):"
    )
    for a in ANCHORS:
        name, gpus, gpu = a["compare"]
        recipe = next(r for r in RECIPES if r.name == name)
        b = best(recipe, gpus, efficiency, gpu, args.link)
        predicted = f"{100 * b['mfu']:.0f}% ({b['layout']})" if b else "none fits"
        results["anchors"].append({**a, "predicted": predicted})
        model = f"model, {name} on {gpus} x {gpu}: {predicted} [{flag}]"
        print(f"- {a['what']}: {a['mfu']} [{a['source']}]; {model}")
    if args.json:
        benchlib.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
