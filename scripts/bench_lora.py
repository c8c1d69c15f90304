"""LoRA against full fine-tuning: training state per GPU, checkpoint size and step time, side by side.

    python scripts/bench_lora.py [--rank 32] [--gpus 1 8] [--step-size DiT-demo] [--json out.json]
    python scripts/bench_lora.py --tiny      # seconds: DiT-tiny, rank 4

- memory per GPU, counted on the meta device, sharded as FSDP2 does (Wan2.1-1.3B, 14B): full, 20 bytes a
  parameter (float32 weight, gradient, AdamW's moments, EMA); LoRA, the frozen base in bf16 (or float8:
  model.base_dtype) and 20 bytes an adapter parameter; activations at 480 x 832 x 81 modelled;
- checkpoint: the bytes a checkpoint holds (model, EMA, AdamW: 16 bytes a trained parameter), counted;
- step: one process here, fp32, the same batch, full and LoRA steps interleaved;
- distillation (train.objective=dmd): two LoRAs on one frozen base (the student's 20 bytes a parameter, the
  critic's 16: no EMA), against a full student and critic beside the frozen teacher (20 + 16 + 2).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

GiB = 2**30
FULL_BYTES, ADAPTER_BYTES, FROZEN_BF16 = 20, 20, 2  # per parameter, see the docstring
CHECKPOINT_BYTES = 16  # model + EMA + AdamW's two moments, float32
CRITIC_BYTES = 16  # a critic's parameter: float32 weight, gradient, AdamW's two moments (no EMA)
# Activations with activation checkpointing: 12.3 GiB measured for Wan2.1-1.3B dims at 14,040 tokens on an
# H100 (docs/benchmarks_history.md, "Memory per GPU fine-tuning Wan2.1-1.3B"), scaled by tokens per GPU
# and, for other dims, by width x depth (the stored block inputs): a model, not a measurement.
ACTIVATIONS_GIB, ACTIVATION_TOKENS, ACTIVATION_DIMS = 12.3, 14_040, 1536 * 30
TOKENS_480P_81 = 21 * 30 * 52  # 81 frames -> 21 latent frames, 480 x 832 -> 60 x 104 latent, 1 x 2 x 2


def counts(size: str, rank: int) -> dict:
    """Parameter counts of a Wan-size DiT and of its default LoRA adapters, on the meta device."""
    import torch

    from models.dit.transformer import DiT, DiT_models
    from models.float8 import base_bytes, quantize_blocks
    from models.lora import DEFAULT_TARGETS, add_adapters, is_adapter

    with torch.device("meta"):
        model = DiT(16, 4096, **DiT_models[size])
        add_adapters(model, rank, rank, DEFAULT_TARGETS)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    base = sum(p.numel() for n, p in model.named_parameters() if not is_adapter(n))
    dims = DiT_models[size]["hidden_size"] * DiT_models[size]["depth"]
    for name, p in model.named_parameters():  # the frozen base in bf16, as a LoRA run on a GPU holds it
        if not is_adapter(name):
            p.data = p.data.to(torch.bfloat16)
    bf16 = base_bytes(model)
    quantize_blocks(model)  # model.base_dtype=float8: the blocks' Linear weights in float8, a scale per row
    return {
        "base": base,
        "adapters": adapters,
        "dims": dims,
        "base_bf16": bf16,
        "base_float8": base_bytes(model),
    }


def memory_rows(sizes, rank: int, gpus: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        c = counts(size, rank)
        for n in gpus:
            activations = (
                ACTIVATIONS_GIB * TOKENS_480P_81 / n / ACTIVATION_TOKENS * c["dims"] / ACTIVATION_DIMS
            )
            full = c["base"] * FULL_BYTES / n / GiB
            lora = (c["base"] * FROZEN_BF16 + c["adapters"] * ADAPTER_BYTES) / n / GiB
            float8 = (c["base_float8"] + c["adapters"] * ADAPTER_BYTES) / n / GiB
            rows.append(
                dict(
                    size=size,
                    rank=rank,
                    gpus=n,
                    base=c["base"],
                    adapters=c["adapters"],
                    full_gib=full,
                    lora_gib=lora,
                    ratio=lora / full,
                    float8_gib=float8,
                    base_ratio=c["base_float8"] / c["base_bf16"],
                    activations_gib=activations,
                )
            )
    return rows


def checkpoint_rows(sizes, rank: int) -> list[dict]:
    rows = []
    for size in sizes:
        c = counts(size, rank)
        full, lora = c["base"] * CHECKPOINT_BYTES, c["adapters"] * CHECKPOINT_BYTES
        rows.append(dict(size=size, rank=rank, full_bytes=full, lora_bytes=lora, ratio=lora / full))
    return rows


def distill_rows(sizes, rank: int, gpus: list[int]) -> list[dict]:
    """Distillation's state per GPU: two LoRAs (the student's and the critic's, each `rank`) on one frozen
    bf16 base, against a full student, a full critic and the frozen teacher; sharded over `gpus`."""
    rows = []
    for size in sizes:
        c = counts(size, rank)  # the critic's adapters have the student's shapes (add_adapters critic=True)
        two_loras = c["base"] * FROZEN_BF16 + c["adapters"] * (ADAPTER_BYTES + CRITIC_BYTES)
        copies = c["base"] * (FULL_BYTES + CRITIC_BYTES + FROZEN_BF16)
        for n in gpus:
            rows.append(dict(size=size, rank=rank, gpus=n, loras_gib=two_loras / n / GiB,
                             full_gib=copies / n / GiB, ratio=two_loras / copies))  # fmt: skip
    return rows


def step_times(size: str, rank: int, repeats: int, tokens: tuple) -> dict:
    """Seconds per training step, full and LoRA, interleaved on one process (fp32, this machine)."""
    import torch

    from configs import load_config
    from models.dit.transformer import DiT, DiT_models
    from models.flow import RectifiedFlow
    from models.lora import DEFAULT_TARGETS, adapter_parameters, add_adapters

    flow = RectifiedFlow(load_config(None).flow, (1, 2, 2))
    g = torch.Generator().manual_seed(0)
    frames, height, width = tokens
    x0 = torch.randn(2, 16, frames, height, width, generator=g)
    y, mask = torch.randn(2, 32, 64, generator=g), torch.ones(2, 32, dtype=torch.bool)
    noise, t = torch.randn(x0.shape, generator=g), torch.rand(2, generator=g)

    def trainer(lora: bool):
        torch.manual_seed(0)
        model = DiT(16, 64, **DiT_models[size])
        if lora:
            add_adapters(model, rank, rank, DEFAULT_TARGETS)
        params = adapter_parameters(model) if lora else list(model.parameters())
        ema = [p.detach().clone() for p in params]
        optimizer = torch.optim.AdamW(params, lr=1e-4)

        def step():
            loss = flow.training_loss(model, x0, y, mask, noise, t)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                torch._foreach_lerp_(ema, [p.detach() for p in params], 0.001)

        return step

    full, lora = trainer(False), trainer(True)
    times = {"full": [], "lora": []}
    for _ in range(repeats):  # interleaved: a busy moment of the machine hits both alike
        for name, step in (("full", full), ("lora", lora)):
            times[name] += benchlib.measure(step, repeats=1, warmup=1 if not times[name] else 0).wall
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {
        "size": size,
        "rank": rank,
        "tokens": tokens,
        **{f"{k}_s": v for k, v in median.items()},
        "ratio": median["lora"] / median["full"],
    }


def main(argv=None):
    p = benchlib.parser(__doc__)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 8])
    p.add_argument("--sizes", nargs="+", default=["Wan2.1-1.3B", "Wan2.1-14B"])
    p.add_argument("--step-size", default="DiT-demo", help="the DiT size of the step-time comparison")
    p.add_argument(
        "--step-latent", type=int, nargs=3, default=[3, 16, 16], help="latent frames, height, width"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--distill-gpus", type=int, nargs="+", default=[8, 64])
    args = benchlib.parse_args(
        p, argv, tiny=dict(rank=4, sizes=["DiT-tiny"], step_size="DiT-tiny", step_latent=[1, 8, 8], repeats=2)
    )
    memory = memory_rows(args.sizes, args.rank, args.gpus)
    print(
        benchlib.table(
            [
                "model",
                "GPUs",
                "full: state per GPU",
                "LoRA r" + str(args.rank) + ": state per GPU",
                "LoRA / full",
                "LoRA, float8 base: state per GPU",
                "float8 / bf16 base bytes",
                "activations per GPU (modelled)",
            ],
            [
                [
                    r["size"],
                    r["gpus"],
                    f"{r['full_gib']:.2f} GiB",
                    f"{r['lora_gib']:.2f} GiB",
                    f"{r['ratio']:.1%}",
                    f"{r['float8_gib']:.2f} GiB",
                    f"{r['base_ratio']:.1%}",
                    f"~{r['activations_gib']:.1f} GiB",
                ]
                for r in memory
            ],
        )
    )
    sizes = ["DiT-demo", *args.sizes] if not args.tiny else args.sizes
    checkpoints = checkpoint_rows(sizes, args.rank)
    print()
    print(
        benchlib.table(
            ["model", "full checkpoint", f"LoRA r{args.rank} checkpoint", "LoRA / full"],
            [
                [
                    r["size"],
                    f"{r['full_bytes'] / GiB:.3f} GiB",
                    f"{r['lora_bytes'] / 2**20:.1f} MiB",
                    f"{r['ratio']:.2%}",
                ]
                for r in checkpoints
            ],
        )
    )
    distill = distill_rows(args.sizes, args.rank, args.distill_gpus)
    print()
    print(
        benchlib.table(
            ["model", "GPUs", f"distillation, two LoRAs r{args.rank}", "full student + critic + teacher",
             "LoRAs / full"],
            [[r["size"], r["gpus"], f"{r['loras_gib']:.2f} GiB", f"{r['full_gib']:.2f} GiB",
              f"{r['ratio']:.1%}"] for r in distill],
        )
    )  # fmt: skip
    step = step_times(args.step_size, args.rank, args.repeats, tuple(args.step_latent))
    print()
    print(
        f"step time, {step['size']}, latent {step['tokens']}, fp32, one process: "
        f"full {step['full_s']:.3f} s, "
        f"LoRA r{args.rank} {step['lora_s']:.3f} s ({step['ratio']:.2f} x)"
    )
    if args.json:
        results = {"memory": memory, "checkpoint": checkpoints, "distill": distill, "step": step}
        benchlib.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
