"""Sequence-parallel benchmark: bytes moved, attention activation memory, time, chunking overhead.

    python scripts/bench_sp.py                       # everything, CPU (gloo), 1, 2 and 4 processes
    python scripts/bench_sp.py --parts bytes chunking --tokens 4096
    python scripts/bench_sp.py --tiny                # 1 and 2 processes, 256 tokens, a 1 MB all-to-all

One process runs in this one; more are spawned (torch.multiprocessing, gloo on CPU, NCCL on GPU).
Prints one markdown table per part for BENCHMARKS.md, "Sequence parallelism"; docs/benchmarks_history.md
gives the theory the measured bytes are compared with (`theory_bytes` below).
"""

import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.compute import comm  # noqa: E402
from parallel.compute.layout import ParallelLayout  # noqa: E402
from parallel.compute.operators import apply_operators
from parallel.compute.sequence import SequenceParallelAttention, SequenceState  # noqa: E402

LAYOUTS = {
    1: [ParallelLayout()],
    2: [ParallelLayout(ulysses=2), ParallelLayout(ring=2)],
    4: [ParallelLayout(ulysses=4), ParallelLayout(ring=4), ParallelLayout(ulysses=2, ring=2)],
}


def theory_bytes(tokens, hidden, u, r, element_size):
    n = tokens / (u * r)
    ulysses = 4 * n * hidden * (u - 1) / u * element_size
    forward = ulysses + 2 * n * hidden * (r - 1) * element_size
    backward = ulysses + (2 * n * hidden * (r - 1) * element_size + 2 * n * hidden * r * 4 if r > 1 else 0)
    return forward, backward


def local_qkv(tokens, heads, head_dim, groups, device, dtype, seed=0):
    """This rank's slice of q, k, v (B=1, H, N/P, Dh), as the model would hand them over."""
    n = -(-tokens // groups.sp_size)
    g = torch.Generator().manual_seed(seed + groups.sp_rank)
    return [
        torch.randn(1, heads, n, head_dim, generator=g).to(device, dtype).requires_grad_() for _ in range(3)
    ]


def make_operator(groups, tokens):
    from models.attention import SDPAAttention

    state = SequenceState()
    state.tokens = tokens
    return SequenceParallelAttention(groups, state, SDPAAttention())


def measure_bytes(groups, layout, args, device, dtype):
    op = make_operator(groups, args.tokens)
    q, k, v = local_qkv(args.tokens, args.heads, args.head_dim, groups, device, dtype)
    comm.reset_stats()
    out = op(q, k, v)
    forward = sum(comm.stats()["sent"].values())
    comm.reset_stats()
    out.backward(torch.ones_like(out))
    backward = sum(comm.stats()["sent"].values())
    theory = theory_bytes(
        args.tokens, args.heads * args.head_dim, layout.ulysses, layout.ring, q.element_size()
    )
    return {
        "forward": forward,
        "backward": backward,
        "theory_forward": theory[0],
        "theory_backward": theory[1],
    }


def measure_memory(groups, layout, args, device, dtype):
    """Bytes saved for backward by one attention layer (the attention activations), this rank."""
    op = make_operator(groups, args.memory_tokens)
    q, k, v = local_qkv(args.memory_tokens, args.heads, args.head_dim, groups, device, dtype)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if groups.sp_size == 1:  # the model's own attention (nothing is installed at degree 1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        else:
            out = op(q, k, v)
    del out
    return {"saved_bytes": sum(storages.values())}


def timed(fn, repeats):
    """Median seconds of fn(), every rank starting together (after a barrier)."""
    return benchlib.measure(fn, repeats, warmup=0, before=dist.barrier, after=benchlib.cuda_sync()).median


def measure_time(groups, layout, args, device, dtype):
    op = make_operator(groups, args.time_tokens)
    q, k, v = local_qkv(args.time_tokens, args.heads, args.head_dim, groups, device, dtype)

    def forward():
        with torch.no_grad():
            op(q, k, v) if groups.sp_size > 1 else torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def forward_backward():
        out = op(q, k, v) if groups.sp_size > 1 else torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out.sum().backward()

    result = {
        "forward_s": timed(forward, args.repeats),
        "forward_backward_s": timed(forward_backward, args.repeats),
    }
    result.update(measure_step(groups, args, device, dtype))
    return result


def measure_step(groups, args, device, dtype):
    """Forward + backward of a small DiT (no optimizer) on one video of args.time_tokens tokens."""
    from models.dit.transformer import DiT

    torch.manual_seed(0)
    model = DiT(
        in_channels=4,
        text_dim=32,
        depth=2,
        hidden_size=args.heads * args.head_dim,
        num_heads=args.heads,
        patch_size=(1, 2, 2),
    ).to(device, dtype)
    apply_operators(model, groups)
    side = int((args.time_tokens // 4) ** 0.5) * 2  # 4 frames of side/2 x side/2 patches
    x = torch.randn(1, 4, 4, side, side, device=device, dtype=dtype)
    t, y, mask = (
        torch.rand(1, device=device),
        torch.randn(1, 8, 32, device=device),
        torch.ones(1, 8, dtype=torch.bool, device=device),
    )

    def step():
        model(x, t, y, mask).square().mean().backward()

    step()  # warm-up
    return {"step_s": timed(step, args.repeats), "step_tokens": 4 * (side // 2) ** 2}


def measure_chunking(args, device):
    """all_to_all of args.chunk_mb per rank, unchunked vs chunked at args.chunk_cap_mb."""
    size = dist.get_world_size()
    elements = int(args.chunk_mb * 2**20 / 4) // size * size
    send = torch.randn(elements, device=device)
    recv = torch.empty_like(send)
    results = {}
    for label, cap in (("unchunked", 1e9), ("chunked", args.chunk_cap_mb)):
        comm.configure(cap)
        comm.all_to_all_single(recv, send, None)  # warm-up
        results[label] = timed(lambda: comm.all_to_all_single(recv, send, None), args.repeats)
    comm.configure(256)
    results["pieces"] = -(-elements * 4 // int(args.chunk_cap_mb * 2**20))
    return results


def worker(rank, world, port, args, out_path):
    from parallel.lifecycle.runtime import sequence_groups

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // world)))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    rows = []
    for layout in LAYOUTS[world]:
        groups = sequence_groups(layout, rank, datetime.timedelta(seconds=600))
        row = {"layout": f"ulysses={layout.ulysses} ring={layout.ring}", "P": layout.sequence_parallel}
        for part in args.parts:
            if part == "bytes" and world > 1:
                row["bytes"] = measure_bytes(groups, layout, args, device, dtype)
            elif part == "memory":
                row["memory"] = measure_memory(groups, layout, args, device, dtype)
            elif part == "time":
                measured = measure_time(groups, layout, args, device, dtype)
                slowest = [None] * world
                dist.all_gather_object(slowest, measured)
                row["time"] = {key: max(m[key] for m in slowest) for key in measured}
        rows.append(row)
    if "chunking" in args.parts and world > 1:
        rows.append({"chunking": measure_chunking(args, device)})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()  # a rank that tears gloo down while its peer still writes aborts now and then at exit
    dist.destroy_process_group()


def main(argv=None):
    parser = benchlib.parser(__doc__)
    parser.add_argument("--parts", nargs="+", default=["bytes", "memory", "time", "chunking"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=4096, help="sequence for the bytes count")
    parser.add_argument("--memory-tokens", type=int, default=32768, help="sequence for the memory figure")
    parser.add_argument("--time-tokens", type=int, default=4096, help="sequence for the timings")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mb", type=float, default=256, help="all-to-all size per rank for chunking")
    parser.add_argument(
        "--chunk-cap-mb", type=float, default=32, help="parallel.max_message_mb for the chunked run"
    )
    tiny = dict(worlds=[1, 2], tokens=256, memory_tokens=256, time_tokens=256, repeats=1)
    args = benchlib.parse_args(parser, argv, tiny={**tiny, "chunk_mb": 1.0, "chunk_cap_mb": 0.25})
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = Path(tmp) / f"world{world}.json"
            started = time.perf_counter()
            spawned = (world, benchlib.free_port(), args, str(out))
            if world == 1:
                worker(0, *spawned)  # one process: this one
            else:
                mp.spawn(worker, args=spawned, nprocs=world, join=True)
            results[world] = json.loads(out.read_text())
            print(f"[bench_sp] {world} process(es): {time.perf_counter() - started:.0f}s", file=sys.stderr)
    report(results, args)
    if args.json:
        benchlib.write_json(args.json, {"args": vars(args), "worlds": results})


def report(results, args):
    device = benchlib.machine()["device"] + ("" if torch.cuda.is_available() else ", gloo")
    print(f"\n{device}; heads={args.heads}, head_dim={args.head_dim}, batch 1\n")
    rows = [r for world in results.values() for r in world if "layout" in r]

    def mib(n, digits=2):
        return f"{n / 2**20:.{digits}f} MiB"

    if "bytes" in args.parts:
        print(f"Bytes sent per rank per attention layer, N={args.tokens}\n")
        lines = []
        for r in (r for r in rows if "bytes" in r):
            b = r["bytes"]
            forward, backward = b["forward"] / b["theory_forward"], b["backward"] / b["theory_backward"]
            lines.append([r["layout"], mib(b["forward"]), mib(b["theory_forward"]), f"{forward:.2f}"])
            lines[-1] += [mib(b["backward"]), mib(b["theory_backward"]), f"{backward:.2f}"]
        print(benchlib.table(["layout", "forward", "theory", "ratio", "backward", "theory", "ratio"], lines))
    if "memory" in args.parts:
        base = next((r["memory"]["saved_bytes"] for r in rows if r["P"] == 1 and "memory" in r), None)
        print(f"\nAttention activations saved for backward per rank, N={args.memory_tokens}\n")
        lines = []
        for r in (r for r in rows if "memory" in r):
            saved = r["memory"]["saved_bytes"]
            ratio = f"{saved / base:.3f}" if base else "-"
            lines.append([r["layout"], mib(saved, 1), ratio, f"{1.2 / r['P']:.3f}"])
        print(benchlib.table(["layout", "saved", "x degree 1", "target (1.2/P)"], lines))
    if "time" in args.parts:
        print(
            f"\nTime (median of {args.repeats}, slowest rank), attention N={args.time_tokens}; DiT step = "
            f"2 blocks forward+backward\n"
        )
        lines = [
            [r["layout"]]
            + [f"{r['time'][key] * 1e3:.1f} ms" for key in ("forward_s", "forward_backward_s", "step_s")]
            + [r["time"]["step_tokens"]]
            for r in rows
            if "time" in r
        ]
        header = ["layout", "attention fwd", "attention fwd+bwd", "DiT step", "step tokens"]
        print(benchlib.table(header, lines))
    chunking = [(w, r["chunking"]) for w, rs in results.items() for r in rs if "chunking" in r]
    if chunking:
        sizes = f"{args.chunk_mb:g} MB per rank, unchunked vs chunked at {args.chunk_cap_mb:g} MB"
        print(f"\nall_to_all of {sizes}\n")
        lines = [
            [world, f"{c['unchunked'] * 1e3:.0f} ms", f"{c['chunked'] * 1e3:.0f} ms", c["pieces"]]
            + [f"{(c['chunked'] / c['unchunked'] - 1) * 100:+.1f}%"]
            for world, c in chunking
        ]
        print(benchlib.table(["processes", "unchunked", "chunked", "pieces", "overhead"], lines))


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
