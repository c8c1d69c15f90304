"""PipeFusion's operators (parallel/compute/pipefusion.py runs the walk): on a stage, each operator that
reads other tokens is replaced, by kind, by one that holds the whole sequence: this step's values for the
patches done, the last step's for the others (zeros, masked, before any), per guidance branch:
- self (tessera's DiT): the keys and values; under ulysses the buffer holds this rank's heads, under ring
  the patch's keys and values are gathered over the ring first (a split inside a stage);
- joint (Qwen-Image): the image keys and values; the text stream travels with each patch and attends
  once per patch (only the image tokens reach the final layer); split inside a stage as self is;
- linear (Sana): the keys and values, summed whole (a zero key adds nothing); grid_conv (Sana): the input
  rows, so a patch's edge rows see their neighbours; under a split both gather the patch's share first;
- cross: unchanged (the text is whole everywhere).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.layers import token_rows
from parallel.compute.sequence import SequenceGroups, all_to_all_dims, gather_tokens


class PatchState:
    """The item being computed, shared by a stage's operators: its tokens start:end of `tokens`, the
    guidance branch passing, the token grid."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.start = self.end = self.branch = 0
        self.grid = None


class _Whole(nn.Module):
    """Replaces an operator of a stage (`local`): per guidance branch, the whole sequence's tensors along
    dim `dim`, the current patch's written in (shared PatchState)."""

    def __init__(self, state: PatchState, local: nn.Module, groups: SequenceGroups | None = None):
        super().__init__()
        self.state, self.local, self.groups = state, local, groups
        self.reset()

    def reset(self) -> None:
        self.held = {}

    def hold(self, *parts, dim: int) -> list:
        """[each part's whole tensor..., the tokens written (bool, on the host)]."""
        s = self.state
        if s.branch not in self.held:
            shape = lambda t: (*t.shape[:dim], s.tokens, *t.shape[dim + 1 :])  # noqa: E731
            self.held[s.branch] = [t.new_zeros(shape(t)) for t in parts] + [torch.zeros(s.tokens, dtype=bool)]
        held = self.held[s.branch]
        for whole, part in zip(held, parts):
            whole.narrow(dim, s.start, s.end - s.start).copy_(part)
        held[-1][s.start : s.end] = True
        return held

    def heads_for_tokens(self, q, k, v) -> tuple:
        """The patch's (q, k, v) of this rank's heads for its whole sequence, the padding cut from k and v:
        ulysses exchanges heads for tokens, ring gathers the ring's slices of k and v (token order)."""
        g, real = self.groups, self.state.end - self.state.start
        if g is not None and g.ulysses_size > 1:  # (B, H, n, Dh) -> (B, H/u, u n, Dh)
            q, k, v = all_to_all_dims(torch.stack((q, k, v)), 2, 3, g.ulysses_group).unbind(0)
        if g is not None and g.ring_size > 1:
            k, v = gather_tokens(torch.stack((k, v)), g.ring_group, dim=-2).unbind(0)
        return q, k[:, :, :real], v[:, :, :real]

    def tokens_for_heads(self, out):
        """heads_for_tokens' inverse for the queries' output: this rank's tokens, every head."""
        g = self.groups
        if g is not None and g.ulysses_size > 1:
            out = all_to_all_dims(out.contiguous(), 2, 1, g.ulysses_group)
        return out

    def whole_patch(self, x, dim: int):
        """The patch's tokens of `x` along `dim`: this rank's share gathered over a split (in token order),
        the padding dropped."""
        g, real = self.groups, self.state.end - self.state.start
        if g is not None and g.sp_size > 1:
            x = gather_tokens(x, g.sp_group, dim=dim)
        return x.narrow(dim, 0, real)


class WholeSelfAttention(_Whole):
    """tessera's DiT's self-attention: the patch's queries attend to every key and value held (keys never
    written masked). Under ulysses the patch's heads are exchanged for its tokens first (the buffer holds
    this rank's heads); under ring the ring's slices of the patch's keys and values are gathered."""

    kind = "self"

    @torch.compiler.disable
    def forward(self, q, k, v):
        q, k, v = self.heads_for_tokens(q, k, v)
        keys, values, written = self.hold(k, v, dim=2)
        mask = None if bool(written.all()) else written.to(q.device, non_blocking=True).view(1, 1, 1, -1)
        # Plain SDPA whatever model.attention_backend says: the queries are a patch, the keys the sequence.
        return self.tokens_for_heads(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))


class WholeJointAttention(_Whole):
    """Qwen-Image's joint attention: the patch's image queries and the text's attend to the text and to
    every image key held (keys never written masked). Under ulysses the patch's image heads are exchanged
    for its tokens and the text's heads of this rank taken (the text's output gathered back whole); under
    ring the ring's slices of the patch's image keys and values are gathered."""

    kind = "joint"

    @torch.compiler.disable
    def forward(self, q, k, v, text_q, text_k, text_v, text_mask):
        g = self.groups
        ulysses = g is not None and g.ulysses_size > 1
        q, k, v = self.heads_for_tokens(q, k, v)
        if ulysses:  # the text (whole on every rank): this rank's heads
            heads = slice(g.ulysses_rank * q.shape[1], (g.ulysses_rank + 1) * q.shape[1])
            text_q, text_k, text_v = text_q[:, heads], text_k[:, heads], text_v[:, heads]
        image, text = self._attend(q, k, v, text_q, text_k, text_v, text_mask)
        if ulysses:
            text = gather_tokens(text.contiguous(), g.ulysses_group, dim=1)  # every head
        return self.tokens_for_heads(image), text

    def _attend(self, q, k, v, text_q, text_k, text_v, text_mask):
        keys, values, written = self.hold(k, v, dim=2)
        B, L = q.shape[0], text_q.shape[2]
        mask = None
        if text_mask is not None or not bool(written.all()):  # else the kernel the whole forward runs
            text_keys = text_mask.bool() if text_mask is not None else q.new_ones(B, L, dtype=torch.bool)
            image_keys = written.to(q.device, non_blocking=True).expand(B, -1)
            mask = torch.cat([text_keys, image_keys], dim=1)[:, None, None, :]
        cat = lambda a, b: torch.cat([a, b], dim=2)  # noqa: E731
        out = self.local.kernel(cat(text_q, q), cat(text_k, keys), cat(text_v, values), mask)
        return out[:, :, L:], out[:, :, :L]


class WholeLinearAttention(_Whole):
    """Sana's linear attention: the patch's queries against the sums over every key and value held (under
    a split, the patch's keys and values gathered first)."""

    kind = "linear"

    @torch.compiler.disable
    def forward(self, q, k, v):
        keys, values, _ = self.hold(self.whole_patch(k, 2), self.whole_patch(v, 2), dim=2)
        return self.local.attend(q, self.local.key_value_sums(keys, values)).to(q.dtype)


class WholeGridConv(_Whole):
    """Sana's 3 x 3 depthwise convolution: the patch's rows convolved with a neighbour row each side (under
    a split, the patch gathered first and this rank's share of the output kept)."""

    kind = "grid_conv"

    @torch.compiler.disable
    def forward(self, tokens, grid):
        s, (_, h, w), local = self.state, self.state.grid, tokens.shape[1]
        whole = self.hold(self.whole_patch(tokens, 1), dim=1)[0]
        top, bottom = s.start // w, s.end // w
        low, high = max(top - 1, 0), min(bottom + 1, h)
        out = self.local(whole[:, low * w : high * w], (1, high - low, w))[
            :, (top - low) * w : (bottom - low) * w
        ]
        g = self.groups
        if g is None or g.sp_size == 1:
            return out
        return token_rows(out, g.sp_rank * local, (g.sp_rank + 1) * local)  # this rank's share, padded


REPLACEMENTS = {
    op.kind: op for op in (WholeSelfAttention, WholeJointAttention, WholeLinearAttention, WholeGridConv)
}
# the operator kinds PipeFusion runs, with ulysses or ring inside a stage too
KINDS = {*REPLACEMENTS, "cross"}


def install(stage_model: nn.Module, state: PatchState, groups: SequenceGroups | None = None) -> list:
    """Replace the operators of `stage_model`'s kept blocks (stage_range) by their whole-sequence ones,
    in place; the list of them (PipeFusion resets them before each sampling)."""
    operators = []
    for index in stage_model.stage_range:
        for module in list(stage_model.blocks[index].modules()):
            for name, child in list(module.named_children()):
                if getattr(child, "kind", None) in REPLACEMENTS:
                    operators.append(REPLACEMENTS[child.kind](state, child, groups))
                    setattr(module, name, operators[-1])
    return operators
