"""PipeFusion sampling (Fang et al., arXiv:2405.14430), `parallel.pipefusion=N`: the DiT's blocks in N
stages, the tokens in patches; after `parallel.pipefusion_warmup` full steps each patch flows through
the stages, attending to one-step-stale K/V for the other patches, and the last stage takes the
patch's solver step and sends it back to stage 0. Only one activation per patch crosses a stage. The
walk is every model's; the DiT's hooks are here, the image families' in parallel/compute/pipefusion_family.py.

No message can hang: every message's shape follows from the plan (parallel/compute/pipefusion_plan.py), which
the ranks compare before the first message and check against what was sent at the end; the two
directions use two process groups. docs/internals.md has the whole protocol.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel.compute import comm
from parallel.compute.cfg import SamplingGroups, branch_text, guided
from parallel.compute.pipefusion_plan import (
    MessagePlan,
    PipeFusionError,
    check_plans,
    local_share,
    message_plan,
    patch_ranges,
    schedule,
)
from parallel.compute.sequence import SequenceGroups, all_to_all_dims, gather_tokens
from parallel.lifecycle.faults import Faults

# ---------------------------------------------------------------------------------------------------
# Attention with a K/V buffer.


class PatchState:
    """The item being computed, shared by the stage's attention operators."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.start = self.end = 0
        self.branch, self.grid = 0, None  # the families': the guidance branch passing, the token grid


class PipeFusionAttention(nn.Module):
    """Replaces SelfAttention.inner_attention on a stage: the queries of the current patch attend to the
    whole sequence's keys and values, held in this layer's buffer: fresh for this patch (and for the
    patches already computed this step), one step old for the others. Under ulysses the buffer holds this
    rank's heads; under ring the patch's K/V are gathered over the ring first. Keys never written (no
    warm-up: the first step's later patches) are masked."""

    def __init__(self, groups: SequenceGroups, state: PatchState):
        super().__init__()
        self.groups, self.state = groups, state
        self.reset()

    def reset(self) -> None:
        self.keys = self.values = self.written = None
        self.complete = False

    @torch.compiler.disable
    def forward(self, q, k, v):
        g, state = self.groups, self.state
        if g.ulysses_size > 1:  # (B, H, n, Dh) -> (B, H/u, u*n, Dh): heads for tokens
            q, k, v = all_to_all_dims(torch.stack((q, k, v)), 2, 3, g.ulysses_group).unbind(0)
        if g.ring_size > 1:  # the ring's slices of the patch's K/V, in token order
            k, v = gather_tokens(torch.stack((k, v)), g.ring_group, dim=-2).unbind(0)
        real = state.end - state.start
        if self.keys is None or self.keys.shape[0] != k.shape[0]:
            shape = (k.shape[0], k.shape[1], state.tokens, k.shape[3])
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
            self.written = torch.zeros(
                state.tokens, dtype=torch.bool
            )  # on the host: no device sync to read it
            self.complete = False
        self.keys[:, :, state.start : state.end] = k[:, :, :real]
        self.values[:, :, state.start : state.end] = v[:, :, :real]
        mask = None
        if not self.complete:
            self.written[state.start : state.end] = True
            self.complete = bool(self.written.all())
            mask = None if self.complete else self.written.to(k.device, non_blocking=True).view(1, 1, 1, -1)
        # Plain SDPA whatever model.attention_backend says: the queries are a patch, the keys the sequence.
        out = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=mask)
        if g.ulysses_size > 1:
            out = all_to_all_dims(out, 2, 1, g.ulysses_group)
        return out


# ---------------------------------------------------------------------------------------------------
# The sampler.


@dataclass
class _Sampling:
    """One call of PipeFusionSampler.sample: its inputs and what is in flight."""

    items: list  # the passes through the stages, in order (schedule)
    steps: int
    guidance: float
    x: torch.Tensor  # (B, N, C*pt*ph*pw): the latent in token order (the last stage's is current)
    sigmas: torch.Tensor
    grid: tuple
    rope: torch.Tensor
    text: tuple  # (y, y_mask) of this rank's branch(es), and the image features (or None) for them
    hidden: tuple  # (batch, width, dtype) of the hidden states between stages
    extra_send: bool  # the failure tests: deviate from the agreed plan at the end
    skipped: dict  # computed step -> the (step, scale) the step cache skips after it (sample.cache)
    condition: object = None  # image-to-video's models.image_condition.ImageCondition, or None
    flow: object = None  # the DiT's models.flow.RectifiedFlow (its sigmas, Euler step and step cache)
    pending_sends: list = field(default_factory=list)
    returns: list = field(default_factory=list)  # (item, buffer, PendingOps) posted by stage 0
    incoming: tuple | None = None  # (buffer, PendingOps) of the next item's hidden states


class PipeFusionSampler:
    """Runs flow-matching sampling for this rank's stage. `stage_model` comes from `keep_stage` (DiT) or
    `keep_blocks` (a family), changed in place (its operators hold the K/V buffers). `faults` (tests
    only) can make this rank plan, or send, what the others do not."""

    def __init__(
        self, stage_model: nn.Module, groups: SamplingGroups, patches: int, warmup: int, faults=None
    ):
        self.model, self.groups = stage_model, groups
        self.patches, self.warmup = patches, warmup
        self.faults = faults or Faults()
        self.state = PatchState(0)
        self.attention = self._install(stage_model)  # the stage's operators that hold the whole sequence
        self.first, self.last = groups.stage == 0, groups.stage == groups.stages - 1
        self.sent = self.received = None

    @torch.no_grad()
    def sample(self, flow, sigmas, noise, y, y_mask, neg_y=None, neg_mask=None, guidance=1.0, progress=None,
               condition=None):  # fmt: skip
        """The latents (on every rank of the replica) at the end of the schedule `sigmas` ((steps + 1,), the
        one the family handed: models/loop.py Schedule), as models/dit/family.py sample_dit walks it.
        `condition`: image-to-video's (models/image_condition.py): stage 0 concatenates its latent to the
        embedded latent's channels (TI2V: puts the given frame in place), every stage gives its features to
        the DiT's conditioning."""
        run = self._begin(flow, sigmas, noise, (y, y_mask, neg_y, neg_mask), guidance, condition)
        self._walk(run, progress)
        return self.model.unpatchify(run.x, run.grid)

    def _walk(self, run, progress) -> None:
        """Every pass of the schedule through this rank's stage, then the final latent on every stage
        (run.x). What is the model's is in the hooks: _step_context, _stage_input, _stage, _velocity,
        _finish_patch."""
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

    # The DiT's hooks (parallel/compute/pipefusion_family.py has the families').

    def _install(self, stage_model) -> list:
        attention = [PipeFusionAttention(self.groups.sequence, self.state) for _ in stage_model.stage_range]
        for index, operator in zip(stage_model.stage_range, attention):
            stage_model.blocks[index].attn.inner_attention = operator
        return attention

    def _step_context(self, run, step: int):
        return self.model.condition(timesteps(run, step, run.hidden[0]), *run.text)

    def _modulation(self, run, cond, item, offset: int, local: int):
        """(c, temb) of this rank's tokens of `item`: a timestep per token (Wan2.2 TI2V) takes their rows."""
        if cond.token_index is None:
            return cond.c, cond.temb
        rows = _share(cond.token_index, 1, item, offset, local)
        return cond.c[rows], cond.temb[rows]

    def _stage(self, run, cond, item, h):
        offset, local = local_share(item, self.groups.sequence.sp_size, self.groups.sequence.sp_rank)
        rope = _share(run.rope, 0, item, offset, local)
        c = self._modulation(run, cond, item, offset, local)[0]
        for block_index in self.model.stage_range:
            h = self.model.blocks[block_index](h, c, cond.y, cond.block_mask, rope)
        return h

    def _velocity(self, run, cond, item, h):
        offset, local = local_share(item, self.groups.sequence.sp_size, self.groups.sequence.sp_rank)
        return self.model.final_layer(h, self._modulation(run, cond, item, offset, local)[1])

    def _patch(self, run, item):
        """The view of run.x that `item` updates (tokens start:end)."""
        return run.x[:, item.start : item.end]

    def _message_tokens(self, run, item) -> int:
        """The tokens of one hidden-state message of `item` (this rank's share)."""
        seq = self.groups.sequence
        return local_share(item, seq.sp_size, seq.sp_rank)[1]

    def _begin(self, flow, sigmas, noise, text, guidance: float, condition=None) -> _Sampling:
        """Agree on the message plan with the pipeline, reset the K/V buffers, and post the first receive."""
        g, model, device, steps = self.groups, self.model, noise.device, len(sigmas) - 1
        grid = tuple(s // p for s, p in zip(noise.shape[2:], model.patch_size))
        tokens = grid[0] * grid[1] * grid[2]
        patches = patch_ranges(grid, self.patches)
        # sample.cache=calibrated: skipped steps run on no stage; the last stage applies them to each patch
        cache_plan = flow.cache.plan(steps) if flow.cache is not None else None
        computed = [i for i in range(steps) if cache_plan is None or cache_plan[i].compute]
        skipped, last_computed = {i: [] for i in computed}, 0
        for i in range(steps):
            if i in skipped:
                last_computed = i
            else:
                skipped[last_computed].append((i, cache_plan[i].scale))
        if flow.cache is not None:
            flow.cache.start(steps, noise.shape[0])
        flow.model_calls = len(computed)
        branch = branch_text(g, *text, guidance)
        features = None if condition is None else condition.features
        if features is not None and guidance != 1.0 and g.cfg_size == 1:  # both branches as one batch
            features = torch.cat([features, features])
        hidden = (branch[0].shape[0], model.architecture()["hidden_size"], _activation_dtype(model, device))
        run = _Sampling(
            items=schedule(steps, self.warmup, patches, tokens, computed),
            steps=steps,
            guidance=guidance,
            x=patchify(noise.float(), model.patch_size),
            sigmas=sigmas.to(device),
            grid=grid,
            rope=model.rope(grid, device),
            text=(*branch, features),
            hidden=hidden,
            extra_send=self.faults.planned("pipefusion_extra_send"),
            skipped=skipped,
            condition=condition,
            flow=flow,
        )
        self._start(run, patches, tokens, None if cache_plan is None else computed)
        return run

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

    def _hidden_buffer(self, run: _Sampling, item) -> torch.Tensor:
        batch, width, dtype = run.hidden
        return torch.empty((batch, self._message_tokens(run, item), width), dtype=dtype, device=run.x.device)

    def _post_forward_recv(self, run: _Sampling, item) -> None:
        """Post the receive of `item`'s hidden states from the previous stage (none on stage 0)."""
        if self.first or item is None:
            return
        buffer = self._hidden_buffer(run, item)
        previous = self.groups.pipeline_ranks[self.groups.stage - 1]
        run.incoming = (buffer, comm.post(recvs=[(buffer, previous)], group=self.groups.forward_group))
        self.received["forward"] += 1

    def _post_returns(self, run: _Sampling, step: int) -> None:
        """Stage 0: this step's returned patches, posted before the last stage can send any of them."""
        g = self.groups
        for returned in (it for it in run.items if it.step == step):
            buffer = torch.empty_like(self._patch(run, returned), memory_format=torch.contiguous_format)
            ops = comm.post(recvs=[(buffer, g.pipeline_ranks[-1])], group=g.return_group)
            run.returns.append((returned, buffer, ops))
            self.received["return"] += 1

    def _stage_input(self, run: _Sampling, item, context=None) -> torch.Tensor:
        """This rank's slice of `item`'s hidden states: embedded from the latent on stage 0 (after the
        patches it needs came back), received from the previous stage elsewhere."""
        if not self.first:
            return self._received(run)
        self._take_returns(run, item)
        x = run.x
        # The patch embedding of the whole latent, then the item's tokens: exactly the serial embedding
        # (a conv over a smaller input could round differently); it costs about
        # (C*pt*ph*pw) / (24 * hidden * blocks per stage) of the stage's work per patch.
        latent = self.model.unpatchify(x, run.grid)
        if run.condition is not None and run.condition.first_frame:  # TI2V: the given frame in place
            latent = torch.cat([run.condition.latent.to(latent.dtype), latent[:, :, 1:]], dim=2)
        elif run.condition is not None:  # image-to-video: the mask and the given frames' latents
            latent = torch.cat([latent, run.condition.latent.to(latent.dtype)], dim=1)
        if run.guidance != 1.0 and self.groups.cfg_size == 1:
            latent = torch.cat([latent, latent])
        h = self.model.embed(latent)[0][:, item.start : item.end]
        offset, local = local_share(item, self.groups.sequence.sp_size, self.groups.sequence.sp_rank)
        return _pad_tokens(h, offset + local, dim=1)[:, offset : offset + local]

    def _received(self, run: _Sampling) -> torch.Tensor:
        buffer, ops = run.incoming
        ops.wait()
        return buffer

    def _take_returns(self, run: _Sampling, item) -> None:
        """Stage 0: the patches returned by the last stage up to `item`'s end, written into run.x."""
        while run.returns and run.returns[0][0].step < item.step and run.returns[0][0].start < item.end:
            returned, buffer, ops = run.returns.pop(0)
            ops.wait()
            self._patch(run, returned).copy_(buffer)

    def _send_forward(self, run: _Sampling, h: torch.Tensor, following) -> None:
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

    def _finish_patch(self, run: _Sampling, item, v: torch.Tensor) -> None:
        """The last stage: guide the patch's velocity, take its Euler step, send the patch back to stage 0
        (the final step's latent stays here; xDiT #147: not so)."""
        g = self.groups
        v = guided(v, run.guidance, g)
        v = v if g.sequence.sp_size == 1 else gather_tokens(v, g.sequence.sp_group)  # the padded item
        v = v[:, : item.end - item.start]
        patch = run.flow.euler_step(run.x[:, item.start : item.end], v, run.sigmas, item.step)
        for step, scale in run.skipped[item.step]:  # the cache's skipped steps reuse this velocity, scaled
            patch = run.flow.euler_step(patch, v * scale, run.sigmas, step)
        run.x[:, item.start : item.end] = patch
        self._return_patch(run, item)

    def _return_patch(self, run: _Sampling, item) -> None:
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


def _activation_dtype(model, device) -> torch.dtype:
    """The dtype of the hidden states between blocks, as the serial forward has it: the autocast dtype
    under autocast (the patch embedding's output), else the weights' dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def timesteps(run: _Sampling, step: int, batch: int) -> torch.Tensor:
    """The model's t at `step`: (batch,), or with Wan2.2 TI2V's given first frame one per token, 0 on
    that frame's tokens (models/image_condition.py ConditionedModel)."""
    t = run.sigmas[step].expand(batch)
    if run.condition is None or not run.condition.first_frame:
        return t
    t = t.view(-1, 1).expand(-1, math.prod(run.grid)).clone()
    t[:, : run.grid[1] * run.grid[2]] = 0
    return t


def _share(per_token, dim: int, item, offset: int, local: int):
    """This rank's share of `item`'s tokens of a per-token tensor (rope, or TI2V's modulation)."""
    part = per_token.narrow(dim, item.start, item.end - item.start)
    return _pad_tokens(part, offset + local, dim).narrow(dim, offset, local)


def _pad_tokens(x, length, dim=0):
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, missing]
    return F.pad(x, pad)


def patchify(latent, patch_size):
    """(B, C, T, H, W) -> (B, N, pt*ph*pw*C): token order (t, h, w), channels as DiT.unpatchify expects
    (its inverse)."""
    B, C, T, H, W = latent.shape
    pt, ph, pw = patch_size
    x = latent.view(B, C, T // pt, pt, H // ph, ph, W // pw, pw)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)  # (B, t, h, w, pt, ph, pw, C)
    return x.reshape(B, (T // pt) * (H // ph) * (W // pw), pt * ph * pw * C)
