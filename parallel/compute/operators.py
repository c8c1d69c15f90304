"""Sequence parallelism for the families of models/family.py, by the kind of each operator (DESIGN.md,
Model families): the model's `sequence` pads and slices the tokens after the embedding and gathers them
before the head (parallel/compute/sequence.py), and each operator with a `kind` is replaced by one that stays
exact:
- joint (MMDiT): Ulysses' all-to-all with the text's heads of this rank only, or under ring every rank's
  image keys and values gathered; linear (Sana): key/value sums added over the ranks; grid_conv (Sana's
  3 x 3 convolution): w + 1 neighbour tokens from the adjacent ranks;
- self (LTX-2's video): the DiT's Ulysses / ring attention; whole_queries (LTX-2's video-to-audio: queries
  whole on every rank, keys split): every rank's keys and values gathered;
- cross (keys and values whole on every rank) and whole (a stream whole on every rank): unchanged.
Padded tokens are masked everywhere; each collective is an autograd function (training).
"""

import torch
import torch.nn as nn

from parallel.compute import comm
from parallel.compute.sequence import (
    SequenceGroups,
    SequenceParallelAttention,
    SequenceState,
    ShardedSequence,
    _GatherTokens,
    all_to_all_dims,
)


def gather_keys_values(k, v, groups: SequenceGroups) -> tuple:
    """Every rank's keys and values (B, H, n, Dh each) in rank order, the sequence's (B, H, sp n, Dh), in
    one all-gather (its gradient a reduce-scatter)."""
    B, H, n, Dh = k.shape
    pair = torch.stack((k, v), dim=2).permute(0, 3, 1, 2, 4).flatten(2)  # (B, n, H 2 Dh)
    every = _GatherTokens.apply(pair.contiguous(), groups.sp_group)  # (B, sp n, H 2 Dh)
    k, v = every.view(B, groups.sp_size * n, H, 2, Dh).permute(3, 0, 2, 1, 4).unbind(0)
    return k, v


class SplitJointAttention(nn.Module):
    """Replaces a "joint" operator (image q, k, v (B, H, n, Dh) of this rank's tokens; text q, k, v
    (B, H, L, Dh) whole). Ulysses: heads for tokens on the image side, this rank's heads of the text.
    parallel.ring: not a ring pass but the image keys and values of every rank gathered (an image's
    sequence is short enough), the text's once, so the text queries' output is whole on every rank."""

    kind = "joint"

    def __init__(self, groups: SequenceGroups, sequence: ShardedSequence, local: nn.Module):
        super().__init__()
        self.groups, self.sequence, self.kernel = groups, sequence, local.kernel

    @torch.compiler.disable
    def forward(self, q, k, v, text_q, text_k, text_v, text_mask):
        if self.groups.ring_size > 1:
            k, v = gather_keys_values(k, v, self.groups)  # (B, H, sp n, Dh)
            return self._joint(q, k, v, text_q, text_k, text_v, text_mask)
        g = self.groups
        q, k, v = all_to_all_dims(torch.stack((q, k, v)), 2, 3, g.ulysses_group).unbind(0)  # (B, H/u, N, Dh)
        heads = slice(g.ulysses_rank * q.shape[1], (g.ulysses_rank + 1) * q.shape[1])
        image, text = self._joint(q, k, v, text_q[:, heads], text_k[:, heads], text_v[:, heads], text_mask)
        image = all_to_all_dims(image.contiguous(), 2, 1, g.ulysses_group)  # (B, H, n, Dh)
        return image, _GatherTokens.apply(text.contiguous(), g.ulysses_group)  # text: every head

    def _joint(self, q, k, v, text_q, text_k, text_v, text_mask):
        """(image, text) outputs of the kernel over the text's keys then the whole padded sequence's (N),
        whose padding sits at its end (the rank-ordered sequence's)."""
        B, L, N, real = q.shape[0], text_q.shape[2], k.shape[2], self.sequence.state.tokens
        mask = None  # none at all when nothing is padded: the kernel the single-device path runs
        if text_mask is not None or N > real:
            text_keys = text_mask.bool() if text_mask is not None else q.new_ones(B, L, dtype=torch.bool)
            image_keys = (torch.arange(N, device=q.device) < real).expand(B, N)
            mask = torch.cat([text_keys, image_keys], dim=1)[:, None, None, :]
        out = self.kernel(
            torch.cat([text_q, q], dim=2), torch.cat([text_k, k], dim=2), torch.cat([text_v, v], dim=2), mask
        )
        return out[:, :, L:], out[:, :, :L]


class ShardedLinearAttention(nn.Module):
    """Replaces a "linear" operator: the key/value sums of this rank's real tokens, added over the whole
    sequence-parallel group, then this rank's queries."""

    kind = "linear"

    def __init__(self, groups: SequenceGroups, sequence: ShardedSequence, local: nn.Module):
        super().__init__()
        self.groups, self.sequence, self.local = groups, sequence, local

    @torch.compiler.disable
    def forward(self, q, k, v):
        real = self.sequence.valid_tokens(k.shape[2])
        keep = (torch.arange(k.shape[2], device=k.device) < real).view(1, 1, -1, 1)
        sums = self.local.key_value_sums(k * keep, v)  # a padded token adds nothing
        sums = _AllReduce.apply(sums, self.groups.sp_group)
        return self.local.attend(q, sums).to(q.dtype)


class HaloGridConv(nn.Module):
    """Replaces a "grid_conv" operator (a 3 x 3 depthwise convolution over one frame's (h, w) grid, tokens
    in row order): this rank's tokens with the w + 1 tokens before and after them (from the adjacent ranks;
    zeros beyond the grid), the nine taps added with each column's edge masked."""

    kind = "grid_conv"

    def __init__(self, groups: SequenceGroups, sequence: ShardedSequence, local: nn.Module):
        super().__init__()
        self.groups, self.sequence = groups, sequence
        self.weight, self.bias = (
            local.weight,
            local.bias,
        )  # the convolution's names: its weights load as they are

    @torch.compiler.disable
    def forward(self, tokens, grid):
        (t, h, w), (B, n, C) = grid, tokens.shape
        g, halo = self.groups, w + 1
        if t != 1 or n < halo:
            raise ValueError(
                f"the grid convolution under sequence parallelism needs one frame and at least {halo} tokens "
                f"per rank (a row and one): {n} tokens per rank over a {h} x {w} grid; use fewer ranks"
            )
        real = self.sequence.valid_tokens(n)
        tokens = tokens * (torch.arange(n, device=tokens.device) < real).view(1, -1, 1)  # padding: zeros
        ends = torch.cat([tokens[:, :halo], tokens[:, -halo:]], dim=1).contiguous()
        every = _GatherTokens.apply(ends, g.sp_group).view(B, g.sp_size, 2 * halo, C)
        zeros = tokens.new_zeros(B, halo, C)
        before = every[:, g.sp_rank - 1, halo:] if g.sp_rank > 0 else zeros
        after = every[:, g.sp_rank + 1, :halo] if g.sp_rank + 1 < g.sp_size else zeros
        extended = torch.cat([before, tokens, after], dim=1)  # (B, n + 2 halo, C)
        column = (torch.arange(n, device=tokens.device) + g.sp_rank * n) % w
        weight, extended = self.weight.float().view(C, 3, 3), extended.float()
        out = self.bias.float().view(1, 1, C).expand(B, n, C).clone()
        for di in (-1, 0, 1):  # summed in float32 and rounded once, as conv2d's accumulator
            for dj in (-1, 0, 1):
                start = halo + di * w + dj
                inside = ((column + dj >= 0) & (column + dj < w)).view(1, -1, 1)
                out = out + extended[:, start : start + n] * weight[:, di + 1, dj + 1] * inside
        return out.to(tokens.dtype)


class _AllReduce(torch.autograd.Function):
    """The sum over the group; backward: the gradients' sum (each rank's output used the whole sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x.clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), group=ctx.group), None


class ShardedSelfAttention(SequenceParallelAttention):
    """Replaces a "self" operator (q, k, v (B, H, n, Dh) of this rank's tokens): the DiT's attention under
    ulysses, ring or both, the padding masked."""

    kind = "self"

    def __init__(self, groups: SequenceGroups, sequence: ShardedSequence, local: nn.Module):
        super().__init__(groups, sequence.state, local)


class GatheredKeysAttention(nn.Module):
    """Replaces a "whole_queries" operator: queries (B, H, L, Dh) whole on every rank, keys and values
    (B, H, n, Dh) of this rank's tokens: every rank's gathered in rank order (the sequence's order), the
    padding at the end masked; the output is whole, the same on every rank."""

    kind = "whole_queries"

    def __init__(self, groups: SequenceGroups, sequence: ShardedSequence, local: nn.Module):
        super().__init__()
        self.groups, self.sequence, self.kernel = groups, sequence, local.kernel

    @torch.compiler.disable
    def forward(self, q, k, v):
        k, v = gather_keys_values(k, v, self.groups)  # (B, H, N, Dh)
        real, mask = self.sequence.state.tokens, None  # no mask when nothing is padded: the local kernel's
        if k.shape[2] > real:
            mask = (torch.arange(k.shape[2], device=q.device) < real).view(1, 1, 1, -1)
        return self.kernel(q, k, v, mask)


REPLACEMENTS = {
    "joint": SplitJointAttention,
    "linear": ShardedLinearAttention,
    "grid_conv": HaloGridConv,
    "self": ShardedSelfAttention,
    "whole_queries": GatheredKeysAttention,
}
UNCHANGED = {"cross", "whole"}  # keys and values (or the whole stream) already on every rank


def operator_kinds(model: nn.Module) -> set:
    return {module.kind for module in model.modules() if hasattr(module, "kind")}


def check_sequence_layout(model: nn.Module, ulysses: int, ring: int, title: str) -> None:
    """Refuse by name a split the model's operators cannot stay exact under (before any collective)."""
    kinds = operator_kinds(model)
    unknown = kinds - {*REPLACEMENTS, *UNCHANGED}
    if unknown and ulysses * ring > 1:
        raise ValueError(
            f"{title} has operators of kind {sorted(unknown)}, which no sequence split handles yet"
        )
    if ring > 1 and ulysses > 1 and "joint" in kinds:
        raise ValueError(
            f"{title}'s joint attention splits under parallel.ulysses or parallel.ring, not both "
            f"(ulysses={ulysses} x ring={ring}): use one of them"
        )


def apply_operators(model: nn.Module, groups: SequenceGroups) -> nn.Module:
    """Make a family's single-device transformer sequence parallel over `groups`, operator by kind."""
    if groups.sp_size == 1:
        return model
    state = SequenceState()
    model.sequence = ShardedSequence(groups, state)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            kind = getattr(child, "kind", None)
            if kind in REPLACEMENTS and not isinstance(child, tuple(REPLACEMENTS.values())):
                setattr(module, name, REPLACEMENTS[kind](groups, model.sequence, child))
    return model
