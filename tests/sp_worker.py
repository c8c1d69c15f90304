"""Sequence-parallel checks run by tests/test_sequence_parallel.py under torchrun (gloo, CPU).

Every rank builds the full inputs from one seed and computes the single-process reference itself
(float64 attention on the whole sequence); the sequence-parallel result must match it, forward and
gradients. One launch runs many layouts and token counts (processes are expensive to start).
Prints `ok <check>` per passed check; any mismatch raises, so the exit code is non-zero.
"""

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.attention import SDPAAttention  # noqa: E402
from models.dit.transformer import WAN_OPTIONS, DiT  # noqa: E402
from parallel.compute import comm  # noqa: E402
from parallel.compute.layout import ParallelLayout  # noqa: E402
from parallel.compute.sequence import SequenceParallelAttention, SequenceState, ShardedSequence  # noqa: E402
from parallel.lifecycle.runtime import sequence_groups  # noqa: E402

TOLERANCE = 1e-5  # the attention operator: max abs error relative to the reference's scale
MODEL_TOLERANCE = 5e-5  # a whole DiT in float32 (weights of std 0.2): summation order differs more


def reference_attention(q, k, v):
    scores = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.softmax(-1) @ v.double()


def relative_error(a, b):
    if b.numel() == 0:  # a rank that holds only padding
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


def check(name, error, tolerance=TOLERANCE):
    if not error <= tolerance:
        raise AssertionError(f"{name}: relative error {error:.2e} > {tolerance:.0e}")
    if dist.get_rank() == 0:
        print(f"ok {name} ({error:.1e})", flush=True)


def check_operator(layout, groups, tokens, heads=4, batch=2, head_dim=8, dtype=torch.float32, label=""):
    name = f"attention u{layout.ulysses}r{layout.ring} N={tokens}{label}"
    tolerance = TOLERANCE if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(tokens)
    q, k, v, weight = (
        torch.randn(batch, heads, tokens, head_dim, generator=g, dtype=torch.float64) for _ in range(4)
    )
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    reference = reference_attention(q64, k64, v64)
    (reference * weight).sum().backward()

    state = SequenceState()
    sharding = ShardedSequence(groups, state)
    attention = SequenceParallelAttention(groups, state, local_attention=SDPAAttention())
    dummy_rope = torch.zeros(tokens, 1, 2)

    def local(t):  # (B, H, N, Dh) -> this rank's padded token slice, as the model would see it
        shard, _ = sharding.shard(t.transpose(1, 2).flatten(2), dummy_rope)
        return shard.view(batch, -1, heads, head_dim).transpose(1, 2).to(dtype).contiguous().requires_grad_()

    ql, kl, vl = local(q), local(k), local(v)
    out = attention(ql, kl, vl)
    n = ql.shape[-2]
    start = groups.sp_rank * n
    real = max(0, min(n, tokens - start))  # this rank's unpadded queries
    check(
        f"{name} forward",
        relative_error(out[:, :, :real], reference[:, :, start : start + real].detach()),
        tolerance,
    )
    (out[:, :, :real] * weight[:, :, start : start + real].to(dtype)).sum().backward()
    for label, mine, full in (("dq", ql, q64), ("dk", kl, k64), ("dv", vl, v64)):
        if mine.grad.dtype != dtype:
            raise AssertionError(f"{name} {label}: gradient dtype {mine.grad.dtype}, expected {dtype}")
        error = relative_error(mine.grad[:, :, :real], full.grad[:, :, start : start + real])
        padded_grad = mine.grad[:, :, real:].abs().max().item() if real < n else 0.0
        check(f"{name} {label}", max(error, padded_grad), tolerance)


def check_model(layout, groups, frames, height=8, width=8, wan=False, image=False):
    """A whole DiT: the output equals the single-process one, and the parameter gradients averaged over
    the sequence-parallel group (what FSDP's mean does) equal the single-process gradients. wan: with
    Wan's options (adaLN-single, QK norm across heads, unmasked text), exact against diffusers in
    tests/test_wan.py; otherwise with absolute positions, added before the sequence is split. image:
    Wan's image-to-video conditioning too (the image's context tokens are never split)."""
    model_name = ("WanI2V" if image else "WanDiT") if wan else "DiT"
    name = f"{model_name} u{layout.ulysses}r{layout.ring} grid {frames}x{height // 2}x{width // 2}"
    options = dict(WAN_OPTIONS, ffn_dim=48) if wan else dict(absolute_positions=True)
    if image:
        options.update(image_dim=20, image_tokens=3)
    torch.manual_seed(0)
    reference_model = DiT(
        in_channels=4, text_dim=16, depth=2, hidden_size=32, num_heads=4, patch_size=(1, 2, 2), **options
    )
    for p in reference_model.parameters():  # adaLN-Zero starts as the identity: make every path count
        torch.nn.init.normal_(p, std=0.2)
    model = DiT(
        in_channels=4, text_dim=16, depth=2, hidden_size=32, num_heads=4, patch_size=(1, 2, 2), **options
    )
    model.load_state_dict(reference_model.state_dict())
    from parallel.compute.operators import apply_operators

    apply_operators(model, groups)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, frames, height, width, generator=g)
    t = torch.rand(2, generator=g)
    y = torch.randn(2, 5, 16, generator=g)
    y_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    target = torch.randn(x.shape, generator=g)
    features = torch.randn(2, 3, 20, generator=g) if image else None
    expected = reference_model(x, t, y, y_mask, features)
    ((expected - target) ** 2).mean().backward()
    out = model(x, t, y, y_mask, features)
    check(f"{name} forward", relative_error(out.detach(), expected.detach()), MODEL_TOLERANCE)
    ((out - target) ** 2).mean().backward()
    worst = 0.0
    for (_name, p), ref in zip(model.named_parameters(), reference_model.parameters()):
        grad = p.grad.clone()
        comm.all_reduce(grad, group=groups.sp_group)
        grad /= groups.sp_size  # every rank's loss is the whole loss: the group's sum is sp_size times it
        worst = max(worst, relative_error(grad, ref.grad))
    check(f"{name} parameter gradients", worst, MODEL_TOLERANCE)


def check_ring_variants(layout, groups):
    """The float32 reference kernel (the fallback when a fast kernel disagrees), p2p messages cut into
    pieces, and bfloat16 inputs (gradients must come back in bfloat16)."""
    from parallel.compute import ring

    saved = dict(ring._checked_kernels)
    ring._checked_kernels.update({("cpu", torch.float32, 8): ring.MathKernel})
    comm.configure(0.0005)  # ~130 floats: every K/V and dK/dV transfer goes in several pieces
    try:
        check_operator(layout, groups, 6 * layout.sequence_parallel - 1, label=" math kernel, chunked p2p")
    finally:
        comm.configure(256)
        ring._checked_kernels.clear()
        ring._checked_kernels.update(saved)
    check_operator(layout, groups, 6 * layout.sequence_parallel - 1, dtype=torch.bfloat16, label=" bf16")


def check_chunking(group):
    """Chunked and unchunked collectives give identical results."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    data = torch.arange(size * 1000, dtype=torch.float32) + 10000 * rank
    results = []
    for cap_mb in (256, 0.001):  # 0.001 MB = 262 floats: several pieces
        comm.configure(cap_mb)
        a2a = torch.empty_like(data)
        comm.all_to_all_single(a2a, data, group)
        gathered = torch.empty(size * data.numel())
        comm.all_gather_into_tensor(gathered, data, group)
        scattered = torch.empty(1000)
        comm.reduce_scatter_tensor(scattered, data, group)
        results.append((a2a, gathered, scattered))
    comm.configure(256)
    identical = all(torch.equal(a, b) for a, b in zip(*results))
    # paired send/receive around the ring, whole and in pieces
    to_rank, from_rank = (rank + 1) % size, (rank - 1) % size
    for cap_mb in (256, 0.001):
        comm.configure(cap_mb)
        received = torch.empty_like(data)
        comm.exchange(data, to_rank, received, from_rank, group).wait()
        identical &= torch.equal(received, torch.arange(size * 1000, dtype=torch.float32) + 10000 * from_rank)
        shared = data.clone()  # broadcast from the group's last rank, whole and in pieces
        comm.broadcast(shared, dist.get_global_rank(group, size - 1), group)
        identical &= torch.equal(shared, torch.arange(size * 1000, dtype=torch.float32) + 10000 * (size - 1))
    comm.configure(256)
    expected_a2a = torch.cat(
        [torch.arange(rank * 1000, (rank + 1) * 1000, dtype=torch.float32) + 10000 * j for j in range(size)]
    )
    if not identical or not torch.equal(results[0][0], expected_a2a):
        raise AssertionError("chunked collectives differ from unchunked ones")
    if dist.get_rank() == 0:
        print("ok chunked collectives identical", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=60)
    layouts = {
        4: [
            ParallelLayout(ulysses=4),
            ParallelLayout(ring=4),
            ParallelLayout(ulysses=2, ring=2),
            ParallelLayout(dp=2, ulysses=2),
            ParallelLayout(dp=2, ring=2),
        ],
        3: [ParallelLayout(ring=3)],
        2: [ParallelLayout(ulysses=2), ParallelLayout(ring=2)],
    }[world]
    for layout in layouts:
        groups = sequence_groups(layout, rank, timeout)
        p = layout.sequence_parallel
        for tokens in (6 * p, 6 * p - 1, p + 1):  # divisible, not divisible, almost all padding
            check_operator(layout, groups, tokens)
        check_model(layout, groups, frames=3)  # 3x4x4 = 48 tokens
        check_model(layout, groups, frames=1, height=6, width=10)  # 15 tokens: padded
        check_model(
            layout, groups, frames=1, height=2, width=10
        )  # 5 tokens: at P=4 a rank holds only padding
        check_model(layout, groups, frames=3, height=6, width=8, wan=True)  # 36 tokens
        check_model(layout, groups, frames=1, height=6, width=10, wan=True, image=True)  # 15 tokens: padded
        if layout.ring > 1:
            check_ring_variants(layout, groups)
    check_chunking(dist.group.WORLD)
    stats = comm.stats()
    if rank == 0:
        print(f"ok all checks; comm ops {stats['ops']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_finished()  # gloo threads must not outlive the interpreter
