"""PipeFusion sampling (Fang et al., arXiv:2405.14430), `parallel.pipefusion=N`, for every family whose
transformer offers the patch pieces (embed, patch_context, companion, patch_blocks, patch_final,
unpatchify): its blocks in N stages, the tokens in patches of whole token rows; after
`parallel.pipefusion_warmup` full steps each patch flows through the stages, its operators attending to
one-step-stale values for the other patches (parallel/compute/pipefusion_operators.py), and the last stage
takes the patch's guided velocity and the family's solver step, and sends the patch back to stage 0. Guided
on one pipeline, both branches pass in turn in one message per patch; under cfg=2 each pipeline runs one.
Under ulysses or ring inside a stage, each patch's tokens are split over the stage's ranks.

No message can hang: every message's shape follows from the plan (parallel/compute/pipefusion_plan.py), which
the ranks compare before the first message and check against what was sent at the end; the two
directions use two process groups. docs/internals.md has the whole protocol.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from models.layers import token_rows
from parallel.compute import comm
from parallel.compute.cfg import SamplingGroups, both_branches
from parallel.compute.pipefusion_operators import PatchState, install
from parallel.compute.pipefusion_plan import (
    MessagePlan,
    PipeFusionError,
    check_plans,
    local_share,
    message_plan,
    patch_ranges,
    schedule,
)
from parallel.compute.sequence import gather_tokens
from parallel.lifecycle.faults import Faults


@dataclass
class _Run:
    """One call of PipeFusion.denoise: its inputs and what is in flight. The latent is held as strips:
    (B, C, pt, rows x ph, W), every token row's latent rows one under the other, so that a patch of whole
    token rows is a slice of dim 3 whatever the frames (`rows` latent rows per token row)."""

    items: list  # the passes through the stages, in order (pipefusion_plan.schedule)
    steps: int
    x: torch.Tensor  # the latent as strips, float32 (the last stage's is current)
    grid: tuple  # the token grid (t, h, w)
    rows: int  # latent rows per token row
    hidden: tuple  # (batch, width, dtype) of the hidden states between stages
    extra_send: bool  # the failure tests: deviate from the agreed plan at the end
    skipped: dict  # computed step -> the (step, scale) the step cache skips after it (sample.cache)
    family: object  # models/family.py Family
    pieces: object  # the transformer's patch pieces as this sampling calls them (Steps.patch_pieces)
    schedule: object  # models/loop.py Schedule
    branches: list  # the conditioning of each guidance branch this pipeline runs
    lengths: list  # the companion tokens of each branch (Qwen-Image's text, then any references')
    guidance: float
    uncond: bool  # guided: both branches' velocities are needed
    parts: object = None  # the family's parts (its guidance may read them)
    solver: torch.Tensor | None = None  # the solver's state for the whole latent (DPM-Solver++'s)
    pending_sends: list = field(default_factory=list)
    returns: list = field(default_factory=list)  # (item, buffer, PendingOps) posted by stage 0
    incoming: tuple | None = None  # (buffer, PendingOps) of the next item's hidden states


def to_strips(latent: torch.Tensor, t: int) -> torch.Tensor:
    """(B, C, T, H, W) of t token frames -> (B, C, T / t, t x H, W): the latent frames of one token frame
    along dim 2, the token frames' rows one under the other (a copy, float32)."""
    B, C, T, H, W = latent.shape
    x = latent.float().reshape(B, C, t, T // t, H, W).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B, C, T // t, t * H, W).clone(memory_format=torch.contiguous_format)  # never the input


def from_strips(x: torch.Tensor, t: int) -> torch.Tensor:
    """to_strips' inverse."""
    B, C, pt, rows, W = x.shape
    return x.reshape(B, C, pt, t, rows // t, W).permute(0, 1, 3, 2, 4, 5).reshape(B, C, t * pt, rows // t, W)


class PipeFusion:
    """PipeFusion for this rank's stage. `stage_model` is the family's transformer with this stage's blocks
    (pipefusion_plan.keep_blocks), its operators replaced in place (they hold the whole sequence).
    `faults` (tests only) can make this rank plan, or send, what the others do not. `denoise` is
    models/sampler.py generate_images' `denoise_with`."""

    def __init__(
        self, stage_model: nn.Module, groups: SamplingGroups, patches: int, warmup: int, faults=None
    ):
        self.model, self.groups = stage_model, groups
        self.patches, self.warmup = patches, warmup
        self.faults = faults or Faults()
        self.state = PatchState(0)
        self.attention = install(stage_model, self.state, groups.sequence)
        self.first, self.last = groups.stage == 0, groups.stage == groups.stages - 1
        self.sent = self.received = None

    @torch.no_grad()
    def denoise(self, family, parts, plan, noise, cond, uncond, scale: float, progress=None):
        """The latents at the schedule `plan`'s end (on every rank of the pipeline), as models/loop.py
        denoise walks it, behind the step cache (parts.cache: sample.cache=calibrated skips steps on
        every stage; the last stage applies them)."""
        g = self.groups
        pieces = family.steps.patch_pieces(parts, cond)
        branches = [cond] if uncond is None else [cond, uncond]
        if uncond is not None and g.cfg_size > 1:
            branches = [branches[g.cfg_rank]]
        tokens, grid = pieces.embed(noise)  # every stage: the width and dtype of what passes between them
        t0 = plan.timesteps[0].to(noise.device).expand(noise.shape[0])
        companions = [pieces.companion(pieces.patch_context(t0, c, grid)) for c in branches]
        steps, count = len(plan.timesteps), grid[0] * grid[1] * grid[2]
        computed, skipped = cache_plan(parts.cache, steps, noise.shape[0])
        x, patches = to_strips(noise, grid[0]), patch_ranges(grid, self.patches)
        run = _Run(
            items=schedule(steps, self.warmup, patches, count, computed),
            steps=steps,
            x=x,
            grid=grid,
            rows=x.shape[3] // (grid[0] * grid[1]),
            hidden=(noise.shape[0], tokens.shape[-1], tokens.dtype),
            extra_send=self.faults.planned("pipefusion_extra_send"),
            skipped=skipped,
            family=family,
            pieces=pieces,
            schedule=plan,
            branches=branches,
            lengths=[0 if c is None else c.shape[1] for c in companions],
            guidance=scale,
            uncond=uncond is not None,
            parts=parts,
        )
        self.state.grid = grid
        self._start(run, patches, count, computed)
        self._walk(run, progress)
        return from_strips(run.x, grid[0])

    def _walk(self, run, progress) -> None:
        """Every pass of the schedule through this rank's stage, then the final latent on every stage
        (run.x)."""
        items = run.items
        for index, item in enumerate(items):
            following = items[index + 1] if index + 1 < len(items) else None
            if index == 0 or items[index - 1].step != item.step:  # a new step
                if self.first and item.step < run.steps - 1:
                    self._post_returns(run, item.step)
                context = self._step_context(run, item.step)
            h = self._stage_input(run, item, context)
            self.state.start, self.state.end = item.start, item.end
            h = self._stage(run, context, item, h)
            if not self.last:
                self._send_forward(run, h, following)
            else:
                self._finish_patch(run, item, self._velocity(run, context, item, h))
                self._post_forward_recv(run, following)
            if progress is not None and (following is None or following.step != item.step):
                for step in [item.step] + [j for j, _ in run.skipped[item.step]]:
                    progress(step + 1, run.steps)
            for ops in [ops for ops in run.pending_sends if ops.is_completed()]:
                ops.wait()  # returns at once; stamps the records' end for failure dumps
            run.pending_sends = [ops for ops in run.pending_sends if ops.works]
        self._check_counts(run.x.device)  # before waiting: an unplanned send would never complete
        for ops in run.pending_sends:  # no process leaves with a send in flight
            ops.wait()
        # The last stage holds the final latent; every stage gets it (for the parallel VAE decode).
        if self.groups.stages > 1:
            comm.broadcast(run.x, self.groups.pipeline_ranks[-1], self.groups.forward_group)

    # What runs on a patch: the family's pieces.

    def _share(self, item) -> tuple:
        """(offset, local): this rank's share of `item`'s tokens (all of them without a split)."""
        seq = self.groups.sequence
        return local_share(item, seq.sp_size, seq.sp_rank)

    def _step_context(self, run, step: int):
        t = run.schedule.timesteps[step].to(run.x.device).expand(run.x.shape[0])
        return [run.pieces.patch_context(t, cond, run.grid) for cond in run.branches]

    def _stage_input(self, run, item, context=None):
        """Each branch's [companion, this rank's share of the patch's tokens] in one tensor (B, sum(L + n),
        D): embedded from the whole latent on stage 0 (after the patches it needs came back), received
        from the previous stage elsewhere."""
        if not self.first:
            return self._received(run)
        self._take_returns(run, item)
        # The embedding of the whole latent, then the item's tokens: exactly the serial embedding (a conv
        # over a smaller input could round differently).
        tokens = run.pieces.embed(from_strips(run.x, run.grid[0]))[0][:, item.start : item.end]
        offset, local = self._share(item)
        tokens = token_rows(tokens, offset, offset + local)  # zero-padded past the patch's end
        streams = [run.pieces.companion(ctx) for ctx in context]
        return torch.cat([part for c in streams for part in ([tokens] if c is None else [c, tokens])], dim=1)

    def _split(self, run, item, h) -> list:
        """[(companion or None, tokens)] of each branch from one message."""
        n, parts, at = self._share(item)[1], [], 0
        for length in run.lengths:
            companion = h[:, at : at + length] if length else None
            parts.append((companion, h[:, at + length : at + length + n]))
            at += length + n
        return parts

    def _stage(self, run, context, item, h):
        self.state.start, self.state.end = item.start, item.end
        offset, local = self._share(item)
        start = item.start + offset  # this rank's tokens; past item.end: the split's padding
        out = []
        for branch, (ctx, (companion, tokens)) in enumerate(zip(context, self._split(run, item, h))):
            self.state.branch = branch
            tokens, companion = run.pieces.patch_blocks(
                self.model.stage_range, tokens, companion, ctx, run.grid, start, start + local
            )
            out += [tokens] if companion is None else [companion, tokens]
        return torch.cat(out, dim=1)

    def _velocity(self, run, context, item, h):
        """The patch's guided velocity, as the latent strip rows it covers (B, C, pt, rows, W)."""
        w, n, seq, pieces = run.grid[2], item.end - item.start, self.groups.sequence, run.pieces
        v = []
        for ctx, (_, tokens) in zip(context, self._split(run, item, h)):
            if seq.sp_size > 1:  # the padded patch, in token order
                tokens = gather_tokens(tokens, seq.sp_group)
            out = pieces.patch_final(tokens[:, :n], ctx, item.start, item.end)
            v.append(run.family.steps.prediction(pieces.unpatchify(out, (1, n // w, w))))
        if not run.uncond:
            return v[0]
        if len(v) == 1:  # cfg=2: the other branch from the other pipeline's last stage
            v = both_branches(v[0], self.groups)
        return run.family.guidance.guide(v[0], v[1], run.guidance, run.parts)

    def _patch(self, run, item, latent=None):
        """The strip rows of `item`'s tokens: of run.x, or of `latent` (shaped alike)."""
        w, r = run.grid[2], run.rows
        return (run.x if latent is None else latent)[:, :, :, item.start // w * r : item.end // w * r]

    def _message_tokens(self, run, item) -> int:
        return sum(run.lengths) + len(run.lengths) * self._share(item)[1]

    def _finish_patch(self, run, item, v) -> None:
        """The solver's steps on the patch's rows: the step computed, then the cache's skipped steps after it
        with this velocity scaled (the solver's state, DPM-Solver++'s, kept for the whole latent)."""
        patch = self._patch(run, item)
        state = None if run.solver is None or item.step == 0 else self._patch(run, item, run.solver)
        new = patch
        for step, scale in [(item.step, 1.0), *run.skipped[item.step]]:
            new, state = run.schedule.step(new, v if scale == 1.0 else v * scale, step, state)
        if state is not None:
            if run.solver is None:
                run.solver = torch.zeros_like(run.x, dtype=state.dtype)
            self._patch(run, item, run.solver).copy_(state)
        patch.copy_(new)
        self._return_patch(run, item)

    # The messages.

    def _start(self, run, patches: list, tokens: int, planned) -> None:
        """Agree on the message plan with the pipeline (`planned`: the computed steps, None: every one),
        reset the stage's operators and counts, and post the first receive."""
        g, steps = self.groups, run.steps
        plan_steps = steps + 1 if self.faults.planned("pipefusion_count") else steps  # tests: another --steps
        plan_items = schedule(plan_steps, self.warmup, patches, tokens, planned)
        plan = message_plan(plan_items, g.stage, g.stages, plan_steps, self.warmup, self.patches, tokens)
        self._share_and_check(plan, run.x.device)
        self.state.tokens = tokens
        for operator in self.attention:
            operator.reset()
        self.sent, self.received = {"forward": 0, "return": 0}, {"forward": 0, "return": 0}
        if not self.first:
            self._post_forward_recv(run, run.items[0])

    def _hidden_buffer(self, run: _Run, item) -> torch.Tensor:
        batch, width, dtype = run.hidden
        return torch.empty((batch, self._message_tokens(run, item), width), dtype=dtype, device=run.x.device)

    def _post_forward_recv(self, run: _Run, item) -> None:
        """Post the receive of `item`'s hidden states from the previous stage (none on stage 0)."""
        if self.first or item is None:
            return
        buffer = self._hidden_buffer(run, item)
        previous = self.groups.pipeline_ranks[self.groups.stage - 1]
        run.incoming = (buffer, comm.post(recvs=[(buffer, previous)], group=self.groups.forward_group))
        self.received["forward"] += 1

    def _post_returns(self, run: _Run, step: int) -> None:
        """Stage 0: this step's returned patches, posted before the last stage can send any of them."""
        g = self.groups
        for returned in (it for it in run.items if it.step == step):
            buffer = torch.empty_like(self._patch(run, returned), memory_format=torch.contiguous_format)
            ops = comm.post(recvs=[(buffer, g.pipeline_ranks[-1])], group=g.return_group)
            run.returns.append((returned, buffer, ops))
            self.received["return"] += 1

    def _received(self, run: _Run) -> torch.Tensor:
        buffer, ops = run.incoming
        ops.wait()
        return buffer

    def _take_returns(self, run: _Run, item) -> None:
        """Stage 0: the patches returned by the last stage up to `item`'s end, written into run.x."""
        while run.returns and run.returns[0][0].step < item.step and run.returns[0][0].start < item.end:
            returned, buffer, ops = run.returns.pop(0)
            ops.wait()
            self._patch(run, returned).copy_(buffer)

    def _send_forward(self, run: _Run, h: torch.Tensor, following) -> None:
        """Send the hidden states to the next stage, batched with the receive of the next item's."""
        g = self.groups
        sends, recvs = [(h.to(run.hidden[2]).contiguous(), g.pipeline_ranks[g.stage + 1])], []
        if not self.first and following is not None:
            recvs = [(self._hidden_buffer(run, following), g.pipeline_ranks[g.stage - 1])]
            self.received["forward"] += 1
        ops = comm.post(sends, recvs, g.forward_group)
        self.sent["forward"] += 1
        run.pending_sends.append(ops)
        run.incoming = (recvs[0][0], ops) if recvs else None

    def _return_patch(self, run: _Run, item) -> None:
        """The last stage: send the updated patch back to stage 0 (but the final step's)."""
        g = self.groups
        if item.step < run.steps - 1 or run.extra_send:
            patch = self._patch(run, item).contiguous()
            run.pending_sends.append(comm.post(sends=[(patch, g.pipeline_ranks[0])], group=g.return_group))
            self.sent["return"] += 1

    def _share_and_check(self, plan: MessagePlan, device) -> None:
        """Every rank of the pipeline gets every rank's plan (one small all-gather) and checks them all."""
        g = self.groups
        everyone = torch.empty((g.stages, len(plan.as_tensor())), dtype=torch.int64, device=device)
        comm.all_gather_into_tensor(everyone, plan.as_tensor().to(device), g.forward_group)
        self.plans = [MessagePlan.from_tensor(row) for row in everyone.cpu()]
        check_plans(self.plans, g.pipeline_ranks)
        # NCCL: a group's first op must include all its ranks, and only stage 0 and the last stage ever
        # post point-to-point ops on the return group; one tiny all-reduce starts its communicator.
        comm.all_reduce(torch.zeros(1, device=device), group=g.return_group)

    def _check_counts(self, device) -> None:
        """Every rank learns what every rank of the pipeline sent and received (one small all-gather) and
        compares it with the plans: a rank that deviated is named by all of them alike, so they all stop
        with the same `error:` line instead of one waiting for a message that never comes."""
        g = self.groups
        mine = torch.tensor(
            [self.sent["forward"], self.received["forward"], self.sent["return"], self.received["return"]],
            dtype=torch.int64,
            device=device,
        )
        everyone = torch.empty((g.stages, 4), dtype=torch.int64, device=device)
        comm.all_gather_into_tensor(everyone, mine, g.forward_group)
        problems = []
        for stage, (actual, plan) in enumerate(zip(everyone.cpu().tolist(), self.plans)):
            planned = [plan.forward_sends, plan.forward_recvs, plan.return_sends, plan.return_recvs]
            if actual != planned:
                problems.append(
                    f"rank {g.pipeline_ranks[stage]} (stage {stage}) posted (forward sends, "
                    f"forward receives, return sends, return receives) = {tuple(actual)}, "
                    f"but planned {tuple(planned)}"
                )
        if problems:
            raise PipeFusionError(
                "PipeFusion messages at the end of sampling differ from the plan: "
                + "; ".join(problems)
                + " (a message that no rank will receive: stopping instead of waiting for it)"
            )


def cache_plan(cache, steps: int, batch: int) -> tuple:
    """(the steps that run, {computed step: [(skipped step, scale), ...] after it}) of sample.cache's plan
    (calibrated: skipped steps run on no stage; the last stage applies them with the last velocity scaled);
    (None, every step alone) without a cache."""
    if cache is None:
        return None, {i: [] for i in range(steps)}
    plan = cache.plan(steps)
    computed = [i for i in range(steps) if plan[i].compute]
    skipped, last = {i: [] for i in computed}, 0
    for i in range(steps):
        if i in skipped:
            last = i
        else:
            skipped[last].append((i, plan[i].scale))
    cache.start(steps, batch)
    return computed, skipped
