"""PipeFusion sampling for the families of models/family.py (`parallel.pipefusion=N`): the walk of
parallel/compute/pipefusion.py (stages, patches of whole token rows, the message plan), calling the family's
blocks on a patch (its transformer's patch_context, companion and patch_blocks). The operators that read
other tokens are replaced, by kind, by ones that hold the whole sequence: this step's values for the
patches done, the last step's for the others (zeros, masked, before any):
- joint (Qwen-Image): the image keys and values; the text stream travels with each patch and attends
  once per patch (only the image tokens reach the final layer);
- linear (Sana): the keys and values, summed whole (a zero key adds nothing); grid_conv (Sana): the input
  rows, so a patch's edge rows see their neighbours; cross: unchanged (the text is whole everywhere).
Guided on one pipeline, both branches pass in turn (their texts' lengths differ), each with its own held
sequence, in one message per patch; under cfg=2 each pipeline runs one branch.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel.compute.cfg import both_branches
from parallel.compute.pipefusion import PipeFusionSampler, _Sampling
from parallel.compute.pipefusion_plan import patch_ranges, schedule


class _Whole(nn.Module):
    """Replaces an operator of a stage (`local`): per guidance branch, the whole sequence's tensors along
    dim `dim`, the current patch's written in (shared PatchState)."""

    def __init__(self, state, local: nn.Module):
        super().__init__()
        self.state, self.local = state, local
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


class WholeJointAttention(_Whole):
    """Qwen-Image's joint attention: the patch's image queries and the text's attend to the text and to
    every image key held (keys never written masked)."""

    kind = "joint"

    def forward(self, q, k, v, text_q, text_k, text_v, text_mask):
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
    """Sana's linear attention: the patch's queries against the sums over every key and value held."""

    kind = "linear"

    def forward(self, q, k, v):
        keys, values, _ = self.hold(k, v, dim=2)
        return self.local.attend(q, self.local.key_value_sums(keys, values)).to(q.dtype)


class WholeGridConv(_Whole):
    """Sana's 3 x 3 depthwise convolution: the patch's rows convolved with a neighbour row each side."""

    kind = "grid_conv"

    def forward(self, tokens, grid):
        s, (_, h, w) = self.state, self.state.grid
        whole = self.hold(tokens, dim=1)[0]
        top, bottom = s.start // w, s.end // w
        low, high = max(top - 1, 0), min(bottom + 1, h)
        out = self.local(whole[:, low * w : high * w], (1, high - low, w))
        return out[:, (top - low) * w : (bottom - low) * w]


REPLACEMENTS = {op.kind: op for op in (WholeJointAttention, WholeLinearAttention, WholeGridConv)}
KINDS = {*REPLACEMENTS, "cross"}  # the operator kinds a family's PipeFusion runs


@dataclass
class _FamilyRun(_Sampling):
    """One call of FamilyPipeFusion.denoise: _Sampling's, with run.x the latent (B, C, 1, H, W) float32."""

    family: object = None
    schedule: object = None  # models.loop.Schedule
    branches: list = None  # the conditioning of each guidance branch this pipeline runs
    lengths: list = None  # the companion tokens of each branch (Qwen-Image's text)
    solver: torch.Tensor | None = None  # the solver's state for the whole latent (DPM-Solver++'s)
    uncond: bool = False  # guided: both branches' velocities are needed


class FamilyPipeFusion(PipeFusionSampler):
    """PipeFusion for a family: `stage_model` is its transformer with this stage's blocks (keep_blocks).
    `denoise` is models/sampler.py generate_images' `denoise_with`."""

    def _install(self, stage_model) -> list:
        operators = []
        for index in stage_model.stage_range:
            for module in list(stage_model.blocks[index].modules()):
                for name, child in list(module.named_children()):
                    if getattr(child, "kind", None) in REPLACEMENTS:
                        operators.append(REPLACEMENTS[child.kind](self.state, child))
                        setattr(module, name, operators[-1])
        return operators

    @torch.no_grad()
    def denoise(self, family, parts, plan, noise, cond, uncond, scale: float, progress=None):
        """The latents at the schedule's end (on every rank of the pipeline), as models/loop.py denoise."""
        g, model = self.groups, self.model
        branches = [cond] if uncond is None else [cond, uncond]
        if uncond is not None and g.cfg_size > 1:
            branches = [branches[g.cfg_rank]]
        tokens, grid = model.embed(noise[:1])
        t = plan.timesteps[0].to(noise.device).expand(noise.shape[0])
        companions = [model.companion(model.patch_context(t, c, grid)) for c in branches]
        count = grid[0] * grid[1] * grid[2]
        patches = patch_ranges(grid, self.patches)
        steps = len(plan.timesteps)
        run = _FamilyRun(
            items=schedule(steps, self.warmup, patches, count),
            steps=steps,
            guidance=scale,
            x=noise.float().contiguous(),
            sigmas=plan.sigmas,
            grid=grid,
            rope=None,
            text=None,
            hidden=(noise.shape[0], tokens.shape[-1], tokens.dtype),
            extra_send=self.faults.planned("pipefusion_extra_send"),
            skipped={i: [] for i in range(steps)},
            family=family,
            schedule=plan,
            branches=branches,
            lengths=[0 if c is None else c.shape[1] for c in companions],
            uncond=uncond is not None,
        )
        self.state.grid = grid
        self._start(run, patches, count, None)
        self._walk(run, progress)
        return run.x

    def _step_context(self, run, step: int):
        t = run.schedule.timesteps[step].to(run.x.device).expand(run.x.shape[0])
        return [self.model.patch_context(t, cond, run.grid) for cond in run.branches]

    def _stage_input(self, run, item, context=None):
        """Each branch's [companion, the patch's tokens] in one tensor (B, sum(L + n), D)."""
        if not self.first:
            return self._received(run)
        self._take_returns(run, item)
        tokens = self.model.embed(run.x)[0][:, item.start : item.end]  # the whole latent's embedding
        streams = [self.model.companion(ctx) for ctx in context]
        return torch.cat([part for c in streams for part in ([tokens] if c is None else [c, tokens])], dim=1)

    def _split(self, run, item, h) -> list:
        """[(companion or None, tokens)] of each branch from one message."""
        n, parts, at = item.end - item.start, [], 0
        for length in run.lengths:
            companion = h[:, at : at + length] if length else None
            parts.append((companion, h[:, at + length : at + length + n]))
            at += length + n
        return parts

    def _stage(self, run, context, item, h):
        out = []
        for branch, (ctx, (companion, tokens)) in enumerate(zip(context, self._split(run, item, h))):
            self.state.branch = branch
            tokens, companion = self.model.patch_blocks(
                self.model.stage_range, tokens, companion, ctx, run.grid, item.start, item.end
            )
            out += [tokens] if companion is None else [companion, tokens]
        return torch.cat(out, dim=1)

    def _velocity(self, run, context, item, h):
        """The patch's guided velocity, as the latent rows it covers (B, C, 1, rows p, W)."""
        w, family = run.grid[2], run.family
        rows = (1, (item.end - item.start) // w, w)
        v = [
            family.prediction(self.model.unpatchify(self.model.final_layer(tokens, ctx.temb), rows))
            for ctx, (_, tokens) in zip(context, self._split(run, item, h))
        ]
        if not run.uncond:
            return v[0]
        if len(v) == 1:  # cfg=2: the other branch from the other pipeline's last stage
            v = both_branches(v[0], self.groups)
        return family.guide(v[0], v[1], run.guidance)

    def _patch(self, run, item, latent=None):
        """The latent rows of `item`'s tokens: of run.x, or of `latent` (shaped alike)."""
        w, p = run.grid[2], self.model.patch_size
        return (run.x if latent is None else latent)[:, :, :, item.start // w * p : item.end // w * p]

    def _message_tokens(self, run, item) -> int:
        return sum(run.lengths) + len(run.lengths) * (item.end - item.start)

    def _finish_patch(self, run, item, v) -> None:
        """The solver's step on the patch's rows (its state, DPM-Solver++'s, kept for the whole latent)."""
        patch = self._patch(run, item)
        held = None if run.solver is None or item.step == 0 else self._patch(run, item, run.solver)
        new, state = run.schedule.step(patch, v, item.step, held)
        if state is not None:
            if run.solver is None:
                run.solver = torch.zeros_like(run.x, dtype=state.dtype)
            self._patch(run, item, run.solver).copy_(state)
        patch.copy_(new)
        self._return_patch(run, item)
