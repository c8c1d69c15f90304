"""Everything GPU-specific, measured on one device in one command (BENCHMARKS.md, "Speed on one GPU").

    python scripts/bench_gpu.py [--out runs/bench_gpu] [--tiny] [--variants eager,ac,compile,compile+ac]

Parts (--parts): train (step time, tokens/s, MFU and peak memory of DiT-XL at 256 px and of a DiT at
Wan2.1-1.3B's dims, each with and without torch.compile and activation checkpointing); wan (the same
step for tessera's DiT with Wan's options and for diffusers' WanTransformer3DModel); sp (the
sequence-parallel operator at degree 1 against SDPA); lse (ring attention's log-sum-exp kernels:
self-check and time); sampler (time per Euler step). init_runtime at world size 1 is always timed.
On CUDA: the real sizes in bf16; with no CUDA device, or --tiny, tiny sizes in float32 on CPU (what the
test runs). results.json and results.md (a table for BENCHMARKS.md) go to --out.
"""

import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Dense bf16 peak, TFLOP/s, by a substring of torch.cuda.get_device_name (first match wins).
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("4090", 165.0),
]

# name: model dims, latent (C, T, H, W), batch, text (tokens, dim)
FULL_CASES = {
    "DiT-XL 256px": dict(
        depth=28, hidden=1152, heads=16, ffn=4608, latent=(4, 1, 32, 32), batch=32, text=(120, 4096)
    ),
    "Wan2.1-1.3B dims 33x480x832": dict(
        depth=30,
        hidden=1536,
        heads=12,
        ffn=8960,
        latent=(16, 9, 60, 104),
        batch=1,
        text=(512, 4096),
        wan=True,
    ),
}
TINY_CASES = {
    "tiny image": dict(depth=2, hidden=64, heads=4, ffn=256, latent=(4, 1, 8, 8), batch=4, text=(8, 32)),
    "tiny video (Wan-shaped)": dict(
        depth=2, hidden=96, heads=4, ffn=560, latent=(16, 3, 6, 8), batch=1, text=(16, 32), wan=True
    ),
}
PATCH = (1, 2, 2)


LINEAR_OPS = ("mm", "addmm", "convolution")  # the aten ops of nn.Linear and the patch convolutions


def linear_forward_flops(make_model, case) -> float:
    """Forward FLOPs of every linear layer (and patch convolution) of the model `make_model(case)`
    builds, each over the rows it really processes: video tokens, text tokens (cross-attention's keys
    and values), or once per sample (time embedding, modulation). Read from the model itself with
    torch's FlopCounterMode on fake tensors: no memory is allocated and nothing is computed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    (C, T, H, W), (L, text_dim), B = case["latent"], case["text"], case["batch"]
    with FakeTensorMode(), torch.device("cpu"):
        model = make_model(case)
        inputs = torch.randn(B, C, T, H, W), torch.rand(B), torch.randn(B, L, text_dim)
        with FlopCounterMode(display=False) as counter:
            model(*inputs, torch.ones(B, L, dtype=torch.bool))
    counts = counter.get_flop_counts()["Global"]
    return float(sum(n for op, n in counts.items() if str(op).split(".")[1] in LINEAR_OPS))


def attention_forward_flops(case) -> float:
    """4·S²·d per self-attention layer and 4·S·L·d per cross-attention layer, per sample (S video
    tokens, L text tokens, d the hidden size: two matmuls of 2 FLOPs per multiply-add)."""
    S = math.prod(case["latent"][1:]) // math.prod(PATCH)
    L, d = case["text"][0], case["hidden"]
    return case["batch"] * case["depth"] * (4 * S * S * d + 4 * S * L * d)


def train_flops(make_model, case) -> float:
    """The FLOPs of one training step, as every MFU in BENCHMARKS.md counts them (tessera's and
    diffusers' alike): matmuls 6·N·tokens, i.e. 3 x the linear layers' forward; attention's forward,
    plus its backward at 2.5 x the forward; recomputation and elementwise work excluded."""
    return 3 * linear_forward_flops(make_model, case) + 3.5 * attention_forward_flops(case)


def dit_flops(
    depth, hidden, ffn, tokens, text_tokens, batch, in_channels, text_dim, patch=PATCH, train=False
) -> float:
    """The one formula in closed form, for a Wan-shaped DiT (what `train_flops` counts from the model
    itself; tests/test_bench_gpu.py checks they agree): forward FLOPs of a batch, or with train=True
    of a training step (3 x the linear layers, 3.5 x attention). For the models that scale from dims
    (model_scaling.py, bench_sampling.py's latency model)."""
    N, L, D, Fh = tokens, text_tokens, hidden, ffn
    per_token = 2 * (6 * D * D + 2 * D * Fh)  # q, k, v, out; cross-attention q, out; the MLP
    per_text_token = 2 * 2 * D * D  # cross-attention k, v
    linear = depth * (N * per_token + L * per_text_token)
    linear += 2 * N * 2 * in_channels * math.prod(patch) * D  # patch embedding in, projection out
    linear += 2 * L * (text_dim * D + D * D) + 2 * (256 * D + D * D + 6 * D * D)  # text; time, modulation
    attention = depth * (4 * N * N * D + 4 * N * L * D)
    return batch * (3 * linear + 3.5 * attention if train else linear + attention)


def make_tessera(case, options=None):
    from models.dit import DiT

    return DiT(
        case["latent"][0],
        case["text"][1],
        depth=case["depth"],
        hidden_size=case["hidden"],
        num_heads=case["heads"],
        patch_size=PATCH,
        ffn_dim=case["ffn"],
        **(options or {}),
    )


def make_tessera_wan(case):
    from models.dit import WAN_OPTIONS

    return make_tessera(case, WAN_OPTIONS)


def device_info(device):
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((tf for key, tf in PEAK_TFLOPS if key in name), None)
        info.update(
            device=name, peak_tflops=peak, peak_note="dense bf16, vendor figure" if peak else "unknown device"
        )
    else:
        cores = len(os.sched_getaffinity(0))
        mhz = 2000.0
        try:
            mhz = max(
                float(line.split(":")[1]) for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")
            )
        except (OSError, ValueError):
            pass
        # AVX2: two 8-wide float32 FMA pipes = 32 FLOP/cycle/core at best (Zen 1: 16); take 16.
        info.update(
            device=f"CPU, {cores} cores ({platform.processor() or platform.machine()})",
            peak_tflops=cores * mhz * 1e6 * 16 / 1e12,
            peak_note="ESTIMATE: cores x clock x 16 float32 FLOP/cycle; not a bf16 GPU peak",
        )
    return info


def timed(fn, device, steps, warmup):
    """Median seconds per call of fn() after `warmup` calls."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return benchlib.measure(fn, steps, warmup, after=sync).median


def peak_memory(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_memory(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class WanAdapter(torch.nn.Module):
    """diffusers' WanTransformer3DModel behind tessera's forward(x, t, y, y_mask)."""

    def __init__(self, case):
        super().__init__()
        from diffusers import WanTransformer3DModel

        self.inner = WanTransformer3DModel(
            patch_size=PATCH,
            num_attention_heads=case["heads"],
            attention_head_dim=case["hidden"] // case["heads"],
            in_channels=case["latent"][0],
            out_channels=case["latent"][0],
            text_dim=case["text"][1],
            ffn_dim=case["ffn"],
            num_layers=case["depth"],
        )
        self.blocks = self.inner.blocks  # parallelize_dit shards, checkpoints and compiles these

    def forward(self, x, t, y, y_mask):
        dtype = self.inner.patch_embedding.weight.dtype
        return self.inner(x.to(dtype), t * 1000, y.to(dtype), return_dict=False)[0]


def make_wan(case):
    return WanAdapter(case)


def build(make_model, case, runtime, param_dtype, ac, compile):
    """`make_model(case)` on the device, under FSDP2 (and activation checkpointing, compile) as train.py
    runs it."""
    from parallel.fsdp import parallelize_dit

    torch.manual_seed(0)
    with torch.device(runtime.device):
        model = make_model(case)
    return parallelize_dit(model, runtime.fsdp_mesh, param_dtype, ac, compile)


_FLOPS: dict = {}  # (model, case) -> train_flops: counted once per pair


def bench_train(name, case, make_model, runtime, param_dtype, variant, args, info):
    device = runtime.device
    ac, compile = "ac" in variant.split("+"), "compile" in variant
    reset_memory(device)
    model = build(make_model, case, runtime, param_dtype, ac, compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    C, T, H, W = case["latent"]
    B, (L, text_dim) = case["batch"], case["text"]
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(B, C, T, H, W, device=device, generator=g)
    noise = torch.randn(B, C, T, H, W, device=device, generator=g)
    y = torch.randn(B, L, text_dim, device=device, generator=g)
    y_mask = torch.ones(B, L, dtype=torch.bool, device=device)
    t = torch.rand(B, device=device, generator=g)

    def step():
        t_ = t.view(-1, 1, 1, 1, 1)
        v = model((1 - t_) * x0 + t_ * noise, t, y, y_mask)
        F.mse_loss(v.float(), noise - x0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed(step, device, args.steps, args.warmup + (2 if compile else 0))
    tokens = B * T * H * W // (PATCH[0] * PATCH[1] * PATCH[2])
    key = (make_model.__name__, case["name"])
    flops = _FLOPS[key] = _FLOPS.get(key) or train_flops(make_model, case)
    row = dict(
        case=name,
        variant=variant,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        tflops=flops / seconds / 1e12,
        mfu=flops / seconds / 1e12 / info["peak_tflops"] if info["peak_tflops"] else None,
        peak_gib=peak_memory(device),
        tokens=tokens,
        batch=B,
    )
    return row  # model and optimizer go with this frame: the next case starts from free memory


def bench_sp(runtime, shape, args):
    """SequenceParallelAttention with every degree 1 against F.scaled_dot_product_attention."""
    from models.attention import SDPAAttention
    from parallel.sequence import SequenceGroups, SequenceParallelAttention, SequenceState

    device, dtype = runtime.device, runtime_dtype(runtime)
    groups = SequenceGroups(None, 1, 0, None, [runtime.rank], 0, None, 1, 0)
    state = SequenceState()
    state.tokens = shape[2]
    op = SequenceParallelAttention(groups, state, SDPAAttention())
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def run(fn):
        return lambda: torch.autograd.backward(fn(q, k, v), grad)

    sp = timed(run(op), device, args.steps, args.warmup)
    sdpa = timed(run(F.scaled_dot_product_attention), device, args.steps, args.warmup)
    return dict(shape=list(shape), sp_seconds=sp, sdpa_seconds=sdpa, ratio=sp / sdpa)


def bench_lse(runtime, shape, args):
    from parallel.ring import MathKernel, _kernel_agrees, kernel_candidates

    device, dtype = runtime.device, runtime_dtype(runtime)
    checks = {
        kernel.__name__: _kernel_agrees(kernel, device, dtype, shape[-1])
        for kernel in kernel_candidates(device.type, dtype, shape[-1])
    }
    kernel = next(
        (k for k in kernel_candidates(device.type, dtype, shape[-1]) if checks[k.__name__]), MathKernel
    )
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))

    def lse_step():
        out, lse = kernel.forward(q, k, v, shape[2])
        kernel.backward(dout, q, k, v, out, lse, shape[2])

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    lse_s = timed(lse_step, device, args.steps, args.warmup)
    sdpa_s = timed(
        lambda: torch.autograd.backward(F.scaled_dot_product_attention(qg, kg, vg), dout),
        device,
        args.steps,
        args.warmup,
    )
    return dict(
        kernel=kernel.__name__,
        self_check=checks.get(kernel.__name__, False),
        checks=checks,
        shape=list(shape),
        lse_seconds=lse_s,
        sdpa_seconds=sdpa_s,
        ratio=lse_s / sdpa_s,
    )


def bench_sampler(case, runtime, param_dtype, args):
    from configs import load_config
    from models.flow import RectifiedFlow

    device = runtime.device
    model = build(make_tessera, case, runtime, param_dtype, False, False)
    flow = RectifiedFlow(load_config().flow, PATCH)
    C, T, H, W = case["latent"]
    L, text_dim = case["text"]
    noise = torch.randn(1, C, T, H, W, device=device)
    y, y_mask = torch.randn(1, L, text_dim, device=device), torch.ones(1, L, dtype=torch.bool, device=device)
    steps = args.sampler_steps
    seconds = timed(
        lambda: flow.sample(model, noise, y, y_mask, torch.zeros_like(y), y_mask, steps=steps, guidance=5.0),
        device,
        1,
        1,
    )
    return dict(case=case["name"], steps=steps, seconds_per_step=seconds / steps, guidance=5.0)


def runtime_dtype(runtime):
    return torch.bfloat16 if runtime.device.type == "cuda" else torch.float32


def init(args):
    """init_runtime at world size 1, timed: process group + preflight all-reduce (NCCL on CUDA)."""
    from configs import load_config
    from parallel.layout import ParallelLayout
    from parallel.runtime import init_runtime

    cfg = load_config()
    if torch.cuda.is_available() and not args.tiny:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    runtime = init_runtime(cfg.parallel, ParallelLayout())
    return runtime, time.perf_counter() - t0


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _one_line(error: str) -> str:
    """An error message fit for a markdown table cell."""
    return " ".join(str(error).split()).replace("|", "/")[:200]


def markdown(results) -> str:
    info = results["info"]
    rows = []
    for r in results["train"]:
        if "error" in r:
            rows.append([r["case"], r["variant"], "", _one_line(r["error"]), "", "", "", ""])
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        rows.append(
            [r["case"], r["variant"], f"{r['tokens']:,}", f"{r['seconds']:.4f}", f"{r['tokens_per_s']:,.0f}"]
            + [f"{r['tflops']:.3g}", mfu, _fmt(r["peak_gib"], ".1f")]
        )
    lines = [
        f"Device: {info['device']}; torch {info['torch']}, CUDA {info['cuda']}; {info['date']}; "
        f"mode {results['mode']}; peak {_fmt(info['peak_tflops'], '.3g')} TFLOP/s ({info['peak_note']}).",
        "",
        benchlib.table(
            ["model", "variant", "tokens/step", "s/step", "tokens/s", "TFLOP/s", "MFU", "peak GiB"], rows
        ),
    ]
    for w in results.get("wan_ratio", []):
        lines.append(
            f"\n{w.get('model', 'tessera')} / diffusers Wan, {w['variant']}: "
            f"diffusers {w['wan_seconds']:.4f} s, tessera {w['tessera_seconds']:.4f} s, "
            f"speed ratio **{w['speedup']:.2f}x** (target >= 1.2)"
        )
    if "sp" in results:
        s = results["sp"]
        lines.append(
            f"\nSP operator at degree 1 vs SDPA, fwd+bwd {s['shape']}: {1e3 * s['sp_seconds']:.3f} ms vs "
            f"{1e3 * s['sdpa_seconds']:.3f} ms, **{s['ratio']:.3f}x** (target <= 1.05)"
        )
    if "lse" in results:
        s = results["lse"]
        checks = ", ".join(f"{k} {'passed' if ok else 'FAILED'}" for k, ok in s.get("checks", {}).items())
        lines.append(
            f"\nLSE kernels' self-checks: {checks}. Ring attention's choice, {s['kernel']}: fwd+bwd "
            f"{1e3 * s['lse_seconds']:.3f} ms vs SDPA {1e3 * s['sdpa_seconds']:.3f} ms ({s['ratio']:.2f}x)"
        )
    if "init_seconds" in results:
        lines.append(
            f"\ninit_runtime at world size 1 ({results['backend']}, process group + preflight): "
            f"{results['init_seconds']:.2f} s"
        )
    if "sampler" in results:
        s = results["sampler"]
        lines.append(
            f"\nsampler, {s['case']}, guidance {s['guidance']}: {1e3 * s['seconds_per_step']:.1f} ms per step"
        )
    for part, error in results.get("errors", {}).items():
        lines.append(f"\n{part}: failed: {_one_line(error)}")
    return "\n".join(lines) + "\n"


def save(results, out):
    """Written after every measurement, so a crash or a timeout keeps what was measured."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(markdown(results))


def main(argv=None):
    p = benchlib.parser(__doc__, json_output=False)  # --tiny: automatic without CUDA; float32 on CPU
    p.add_argument("--out", default="runs/bench_gpu")
    p.add_argument("--variants", default="eager,ac,compile,compile+ac")
    p.add_argument("--parts", default="train,wan,sp,lse,sampler")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sampler-steps", type=int, default=5)
    args = p.parse_args(argv)
    args.tiny = args.tiny or not torch.cuda.is_available()
    parts, variants = args.parts.split(","), args.variants.split(",")
    cases = TINY_CASES if args.tiny else FULL_CASES
    runtime, init_seconds = init(args)
    param_dtype = runtime_dtype(runtime)
    info = device_info(runtime.device)
    results = {
        "mode": "tiny" if args.tiny else "full",
        "info": info,
        "backend": runtime.backend,
        "init_seconds": init_seconds,
        "train": [],
        "wan_ratio": [],
    }
    print(f"{info['device']}: init_runtime {init_seconds:.2f} s", flush=True)
    for name, case in cases.items():
        case = {**case, "name": name}
        models = [("tessera", make_tessera)]
        if "wan" in parts and case.get("wan"):
            models += [("tessera, Wan options", make_tessera_wan), ("diffusers Wan", make_wan)]
        for variant in variants if "train" in parts else []:
            by_model = {}
            for label, make_model in models:
                try:
                    row = bench_train(
                        f"{name} ({label})", case, make_model, runtime, param_dtype, variant, args, info
                    )
                except torch.OutOfMemoryError as e:
                    row = dict(
                        case=f"{name} ({label})", variant=variant, error=f"out of memory: {str(e)[:80]}"
                    )
                except Exception as e:  # one broken variant (a compile failure, say) must not lose the others
                    if args.tiny:  # on CPU (the test) a failure is a bug, not a device quirk
                        raise
                    row = dict(
                        case=f"{name} ({label})",
                        variant=variant,
                        error=f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}",
                    )
                results["train"].append(row)
                by_model[label] = row
                print(row, flush=True)
                save(results, args.out)
            for label in ("tessera", "tessera, Wan options"):
                if "seconds" in by_model.get("diffusers Wan", {}) and "seconds" in by_model.get(label, {}):
                    results["wan_ratio"].append(
                        dict(
                            case=name,
                            variant=variant,
                            model=label,
                            wan_seconds=by_model["diffusers Wan"]["seconds"],
                            tessera_seconds=by_model[label]["seconds"],
                            speedup=by_model["diffusers Wan"]["seconds"] / by_model[label]["seconds"],
                        )
                    )
    video = list(cases.values())[-1]
    heads, head_dim = video["heads"], video["hidden"] // video["heads"]
    tokens = video["latent"][1] * video["latent"][2] * video["latent"][3] // 4
    extra = {
        "sp": lambda: bench_sp(runtime, (1, heads, tokens, head_dim), args),
        "lse": lambda: bench_lse(runtime, (1, heads, tokens, head_dim), args),
        "sampler": lambda: bench_sampler({**video, "name": list(cases)[-1]}, runtime, param_dtype, args),
    }
    for part, bench in extra.items():
        if part in parts:
            try:
                results[part] = bench()
            except Exception as e:
                results.setdefault("errors", {})[part] = f"{type(e).__name__}: {str(e)[:200]}"
                if args.tiny:  # on CPU (the test) a failure is a bug, not a device quirk
                    raise
            print(part, results.get(part, results.get("errors", {}).get(part)), flush=True)
            save(results, args.out)
    save(results, args.out)  # also when no part above ran (e.g. --parts nccl)
    print(markdown(results))
    import torch.distributed as dist

    runtime.watchdog.finish()  # this rank leaves on purpose
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
