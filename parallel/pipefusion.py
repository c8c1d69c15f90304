"""Sampling across GPUs: PipeFusion patch pipelining and classifier-free-guidance (CFG) parallelism.

PipeFusion (Fang et al., https://arxiv.org/abs/2405.14430), `parallel.pipefusion=N`:
- the DiT's blocks are split into N contiguous stages; stage r keeps only its blocks' weights
  (`keep_stage`), so weights per rank are about 1/N;
- the token sequence is cut into M = `parallel.pipefusion_patches` patches of whole patch rows, in
  (t, h, w) order, so images and videos are cut alike (`patch_ranges`);
- the first W = `parallel.pipefusion_warmup` steps run synchronously: the whole sequence passes through
  the stages and fills every layer's K/V buffer;
- after that each patch flows through the stages. A layer attends with fresh K/V for the patch and
  one-step-stale K/V for the others, from the full-sequence K/V buffer its stage owns. The last stage
  applies the guidance and the Euler step to the patch and sends the patch's latent back to stage 0.
Only one activation per patch crosses each stage boundary: O(tokens x hidden) bytes per step, whatever
the depth (sequence parallelism moves that much in every layer).

Messages, and why none can hang:
- every message's shape follows from the layout, the latent size and the step/patch schedule
  (`MessagePlan`), so receives are posted ahead with the right shape: no shape handshake;
- the forward direction (stage r -> r+1: hidden states) and the return direction (last stage -> stage
  0: updated latent patches) use two process groups, hence two NCCL communicators: a receive posted
  early on one never queues ahead of a send on the other (NCCL runs one communicator's ops in order);
- on the forward group, a stage posts its send of patch k together with its receive of patch k+1
  (one batch_isend_irecv): neither can wait on the other. Stage 0 posts each step's return receives
  at the start of the step, before the last stage can send them;
- before the first message every rank of a pipeline shares its plan (message counts and the schedule
  that produced them) and checks it against every other rank's: ranks that disagree stop with an
  `error:` naming them, before any message is sent. At the end each rank checks that it sent and
  received exactly what it planned, and waits for its last sends: no process exits with a send pending;
- every message goes through parallel/comm.py (recorded; pieces under `parallel.max_message_mb`).

Inside a stage, ulysses/ring split each patch's tokens as they split the whole sequence elsewhere:
Ulysses exchanges heads for tokens, and Ring gathers the patch's K/V over the ring (the buffer holds
the whole sequence anyway). With `parallel.cfg=2` the two guidance branches are two pipelines, and
their last stages combine each patch with one all-gather.

CFG parallel alone (`cfg_velocity`): each half of the ranks runs one branch, one all-gather per step.
"""

import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel import comm, faults
from parallel.layout import LayoutError
from parallel.sequence import SequenceGroups, all_to_all_dims


@dataclass
class SamplingGroups:
    """This rank's place in the sampling layout (built by parallel/runtime.py)."""

    cfg_group: object  # the ranks that differ only in the guidance branch (None when cfg=1)
    cfg_size: int
    cfg_rank: int  # 0: the conditional branch, 1: the unconditional/negative one (the serial batch order)
    forward_group: object  # the ranks of this pipeline (differ only in stage), for stage -> stage + 1
    return_group: object  # the same ranks, a second communicator, for last stage -> stage 0
    pipeline_ranks: list  # global ranks of this pipeline, in stage order
    stage: int
    sequence: SequenceGroups  # ulysses / ring inside the stage
    replica_group: object  # every rank that works on the same samples (cfg x pipefusion x ulysses x ring)
    replica_size: int
    replica_control: object = (
        None  # the same ranks on gloo with the control timeout: fences the replica's writer
    )

    @property
    def stages(self) -> int:
        return len(self.pipeline_ranks)


class PipeFusionError(RuntimeError):
    """Ranks of a pipeline that disagree on their messages: reported as an `error:` line, no traceback."""


# ---------------------------------------------------------------------------------------------------
# The split of the model and of the sequence.


def stage_blocks(depth: int, stages: int) -> list[range]:
    """Contiguous block ranges, sizes differing by at most one (the earlier stages take the extra)."""
    base, extra = divmod(depth, stages)
    ranges, start = [], 0
    for stage in range(stages):
        size = base + (stage < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def patch_ranges(grid, patches: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) of `patches` patches of whole patch rows (t*h rows of w tokens), sizes
    differing by at most one row."""
    t, h, w = grid
    rows = t * h
    if not 1 <= patches <= rows:
        raise LayoutError(
            f"parallel.pipefusion_patches={patches}: the latent has {rows} patch rows "
            f"({t} x {h} of {w} tokens); use at most {rows} patches"
        )
    bounds = [rows * i // patches for i in range(patches + 1)]
    return [(a * w, b * w) for a, b in zip(bounds, bounds[1:])]


class DroppedBlock(nn.Module):
    """A block that lives on another PipeFusion stage: holds no weights; calling it is a bug."""

    def __init__(self, index: int, stage: int):
        super().__init__()
        self.index, self.stage = index, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"block {self.index} lives on PipeFusion stage {self.stage}, not on this one")


def keep_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """A copy of `model` (sharing its modules, not duplicating them) that holds only stage `stage`'s blocks:
    the others become DroppedBlocks, so the kept blocks keep their names (checkpoint keys, pretrained
    rows and per-parameter seeds address the same weights as in the whole model). The patch embedding
    stays on stage 0 only, the final layer on the last stage only. Works on a meta-device model, before
    any weight is allocated."""
    part = copy.copy(model)
    part._modules = dict(model._modules)  # noqa: SLF001  (a shallow copy must not share the module table)
    ranges = stage_blocks(len(model.blocks), stages)
    owner = {i: s for s, r in enumerate(ranges) for i in r}
    part.blocks = nn.ModuleList(
        [block if owner[i] == stage else DroppedBlock(i, owner[i]) for i, block in enumerate(model.blocks)]
    )
    if stage != 0:
        part.x_embedder = None
    if stage != stages - 1:
        part.final_layer = None
    part.stage_range = ranges[stage]
    return part


# ---------------------------------------------------------------------------------------------------
# The message plan.


@dataclass(frozen=True)
class Item:
    """One pass through the stages: a step's whole sequence (warm-up) or one patch of it."""

    step: int
    start: int
    end: int


def schedule(steps: int, warmup: int, patches: list[tuple[int, int]], tokens: int) -> list[Item]:
    items = []
    for step in range(steps):
        if step < warmup:
            items.append(Item(step, 0, tokens))
        else:
            items += [Item(step, a, b) for a, b in patches]
    return items


def local_share(item: Item, sp_size: int, sp_rank: int) -> tuple[int, int]:
    """(offset in the padded item, local length): the item's tokens, padded to a multiple of the
    sequence-parallel degree, are cut into equal slices as ShardedSequence cuts the whole sequence."""
    local = -(-(item.end - item.start) // sp_size)
    return sp_rank * local, local


@dataclass(frozen=True)
class MessagePlan:
    """What one rank sends and receives, from the layout and the schedule alone."""

    forward_sends: int  # hidden states to the next stage
    forward_recvs: int  # from the previous stage
    return_sends: int  # latent patches, last stage -> stage 0
    return_recvs: int
    steps: int
    warmup: int
    patches: int
    tokens: int

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f) for f in self.__dataclass_fields__], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, values) -> "MessagePlan":
        return cls(*[int(v) for v in values])


def message_plan(
    items: list[Item], stage: int, stages: int, steps: int, warmup: int, patches: int, tokens: int
) -> MessagePlan:
    first, last = stage == 0, stage == stages - 1
    returned = sum(item.step < steps - 1 for item in items)  # the final step's latent stays on the last stage
    return MessagePlan(
        forward_sends=0 if last else len(items),
        forward_recvs=0 if first else len(items),
        return_sends=returned if last else 0,
        return_recvs=returned if first else 0,
        steps=steps,
        warmup=warmup,
        patches=patches,
        tokens=tokens,
    )


def check_plans(plans: list[MessagePlan], pipeline_ranks: list[int]) -> None:
    """Every rank of a pipeline checks every rank's plan against its neighbours' before the first message:
    a stage that would send more or fewer messages than its peer receives would hang the other at the
    end of sampling (xDiT #147). The error names the ranks and what each of them planned."""
    stages = len(plans)
    problems = []
    for stage in range(stages):
        mine, nxt = plans[stage], plans[(stage + 1) % stages]
        if stage < stages - 1 and mine.forward_sends != nxt.forward_recvs:
            problems.append(
                f"rank {pipeline_ranks[stage]} (stage {stage}) plans {mine.forward_sends} messages to rank "
                f"{pipeline_ranks[stage + 1]}, which plans to receive {nxt.forward_recvs}"
            )
    if plans[-1].return_sends != plans[0].return_recvs:
        problems.append(
            f"rank {pipeline_ranks[-1]} (last stage) plans {plans[-1].return_sends} latent patches to rank "
            f"{pipeline_ranks[0]} (stage 0), which plans to receive {plans[0].return_recvs}"
        )
    schedules = {(p.steps, p.warmup, p.patches, p.tokens) for p in plans}
    if problems or len(schedules) > 1:
        described = "; ".join(
            f"rank {r}: steps={p.steps} warmup={p.warmup} patches={p.patches} tokens={p.tokens}"
            for r, p in zip(pipeline_ranks, plans)
        )
        raise PipeFusionError(
            "PipeFusion message plans disagree"
            + (f": {'; '.join(problems)}" if problems else "")
            + f" ({described}); every rank must run the same command and recipe"
        )


# ---------------------------------------------------------------------------------------------------
# Attention with a K/V buffer.


class PatchState:
    """The item being computed, shared by the stage's attention operators."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.start = self.end = 0


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
            k, v = _gather_tokens(torch.stack((k, v)), g.ring_group).unbind(0)
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


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """(..., n, Dh) per rank -> (..., size*n, Dh), the ranks' slices in rank order along tokens."""
    size = dist.get_world_size(group)
    local = x.movedim(-2, 0).contiguous()
    out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, local, group)
    return out.movedim(0, -2)


def _gather_sequence(x: torch.Tensor, groups: SequenceGroups) -> torch.Tensor:
    """(B, n, C) local slice -> (B, sp*n, C), the padded item, on every rank of the sequence group."""
    if groups.sp_size == 1:
        return x
    return _gather_tokens(x, groups.sp_group)


# ---------------------------------------------------------------------------------------------------
# The sampler.


class PipeFusionSampler:
    """Runs flow-matching sampling for this rank's stage. `stage_model` comes from `keep_stage`; it is
    changed in place (its attention operators hold the K/V buffers)."""

    def __init__(self, stage_model: nn.Module, groups: SamplingGroups, patches: int, warmup: int):
        self.model, self.groups = stage_model, groups
        self.patches, self.warmup = patches, warmup
        self.state = PatchState(0)
        self.attention = [PipeFusionAttention(groups.sequence, self.state) for _ in stage_model.stage_range]
        for index, operator in zip(stage_model.stage_range, self.attention):
            stage_model.blocks[index].attn.inner_attention = operator
        self.sent = self.received = None

    @torch.no_grad()
    def sample(
        self,
        flow,
        noise,
        y,
        y_mask,
        neg_y=None,
        neg_mask=None,
        steps: int = 30,
        guidance: float = 1.0,
        progress=None,
    ):
        """The latents (on every rank of the replica): the same contract as RectifiedFlow.sample."""
        g, model = self.groups, self.model
        seq = g.sequence
        first, last = g.stage == 0, g.stage == g.stages - 1
        device = noise.device
        grid = tuple(s // p for s, p in zip(noise.shape[2:], model.patch_size))
        tokens = grid[0] * grid[1] * grid[2]
        items = schedule(steps, self.warmup, patch_ranges(grid, self.patches), tokens)
        plan_steps = steps
        if faults.planned("pipefusion_count", int(os.environ.get("RANK", 0)), 0):
            plan_steps = steps + 1  # the failure tests: one rank plans as if started with another --steps
        plan = message_plan(
            schedule(plan_steps, self.warmup, patch_ranges(grid, self.patches), tokens),
            g.stage,
            g.stages,
            plan_steps,
            self.warmup,
            self.patches,
            tokens,
        )
        self._share_and_check(plan, device)
        # the failure tests: one rank deviates from its (agreed) plan at the end, as xDiT's last stage did
        extra_send = faults.planned("pipefusion_extra_send", int(os.environ.get("RANK", 0)), 0)

        branch_y, branch_mask = (y, y_mask)
        if g.cfg_size > 1 and g.cfg_rank == 1:
            branch_y, branch_mask = neg_y, neg_mask
        guided = guidance != 1.0
        if guided and g.cfg_size == 1:  # both branches in one batch, as the serial sampler does
            branch_y, branch_mask = torch.cat([y, neg_y]), torch.cat([y_mask, neg_mask])
        sigmas = flow.sigmas(noise, steps).to(device)
        batch = branch_y.shape[0]
        x = patchify(noise.float(), model.patch_size)  # (B, N, C*pt*ph*pw): the latent in token order
        rope = model.rope(grid, device)
        hidden_dtype = _activation_dtype(model, device)
        width = model.architecture()["hidden_size"]
        self.state.tokens = tokens
        for operator in self.attention:
            operator.reset()

        pending_sends, returns = [], []  # returns: (item, buffer, PendingOps) posted by stage 0
        self.sent, self.received = {"forward": 0, "return": 0}, {"forward": 0, "return": 0}
        prev_rank = g.pipeline_ranks[g.stage - 1] if not first else None
        next_rank = g.pipeline_ranks[g.stage + 1] if not last else None

        def hidden_buffer(item):
            return torch.empty(
                (batch, local_share(item, seq.sp_size, seq.sp_rank)[1], width),
                dtype=hidden_dtype,
                device=device,
            )

        incoming = None  # (buffer, PendingOps) of the next item's hidden states
        if not first:
            buffer = hidden_buffer(items[0])
            incoming = (buffer, comm.post(recvs=[(buffer, prev_rank)], group=g.forward_group))
            self.received["forward"] += 1
        for index, item in enumerate(items):
            if first and item.step < steps - 1 and (index == 0 or items[index - 1].step != item.step):
                # this step's returned patches, posted before the last stage can send any of them
                for returned in (it for it in items if it.step == item.step):
                    buffer = torch.empty(
                        (x.shape[0], returned.end - returned.start, x.shape[2]),
                        dtype=torch.float32,
                        device=device,
                    )
                    returns.append(
                        (
                            returned,
                            buffer,
                            comm.post(recvs=[(buffer, g.pipeline_ranks[-1])], group=g.return_group),
                        )
                    )
                    self.received["return"] += 1
            if (
                index == 0 or items[index - 1].step != item.step
            ):  # the conditioning changes with the step only
                cond = model.condition(sigmas[item.step].expand(batch), branch_y, branch_mask)
            offset, local = local_share(item, seq.sp_size, seq.sp_rank)
            item_rope = _pad_tokens(rope[item.start : item.end], offset + local)[offset : offset + local]
            if first:
                while returns and returns[0][0].step < item.step and returns[0][0].start < item.end:
                    returned, buffer, ops = returns.pop(0)
                    ops.wait()
                    x[:, returned.start : returned.end] = buffer
                # The patch embedding of the whole latent, then the item's tokens: exactly the serial
                # embedding (a conv over a smaller input could round differently); it costs about
                # (C*pt*ph*pw) / (24 * hidden * blocks per stage) of the stage's work per patch.
                latent = model.unpatchify(x, grid)
                if guided and g.cfg_size == 1:
                    latent = torch.cat([latent, latent])
                h = model.embed(latent)[0][:, item.start : item.end]
                h = _pad_tokens(h, offset + local, dim=1)[:, offset : offset + local]
            else:
                buffer, ops = incoming
                ops.wait()
                h = buffer
            self.state.start, self.state.end = item.start, item.end
            for block_index in model.stage_range:
                h = model.blocks[block_index](h, cond.c, cond.y, cond.block_mask, item_rope)
            following = items[index + 1] if index + 1 < len(items) else None
            if not last:
                sends = [(h.to(hidden_dtype).contiguous(), next_rank)]
                recvs = []
                if not first and following is not None:
                    buffer = hidden_buffer(following)
                    recvs = [(buffer, prev_rank)]
                    self.received["forward"] += 1
                ops = comm.post(sends, recvs, g.forward_group)
                self.sent["forward"] += 1
                pending_sends.append(ops)
                incoming = (recvs[0][0], ops) if recvs else None
            else:
                v = model.final_layer(h, cond.temb)  # (B or 2B, n, C*pt*ph*pw)
                v = self._guide(v, guidance, guided)
                v = _gather_sequence(v, seq)[:, : item.end - item.start]
                x[:, item.start : item.end] = flow.euler_step(
                    x[:, item.start : item.end], v, sigmas, item.step
                )
                if (
                    item.step < steps - 1 or extra_send
                ):  # the final step's latent stays here (xDiT #147: not so)
                    ops = comm.post(
                        sends=[(x[:, item.start : item.end].contiguous(), g.pipeline_ranks[0])],
                        group=g.return_group,
                    )
                    self.sent["return"] += 1
                    pending_sends.append(ops)
                if not first and following is not None:
                    buffer = hidden_buffer(following)
                    incoming = (buffer, comm.post(recvs=[(buffer, prev_rank)], group=g.forward_group))
                    self.received["forward"] += 1
            if progress is not None and (following is None or following.step != item.step):
                progress(item.step + 1, steps)
            for ops in [ops for ops in pending_sends if ops.is_completed()]:
                ops.wait()  # returns at once; stamps the records' end for failure dumps
            pending_sends = [ops for ops in pending_sends if ops.works]
        self._check_counts(device)  # before waiting: an unplanned send would never complete
        for ops in pending_sends:  # no process leaves with a send in flight
            ops.wait()
        # The last stage holds the final latent; every stage gets it (for the parallel VAE decode).
        if g.stages > 1:
            comm.broadcast(x, g.pipeline_ranks[-1], g.forward_group)
        return model.unpatchify(x, grid)

    def _guide(self, v, guidance, guided):
        """The guided velocity of the patch, as the serial sampler computes it (in the model's output dtype)."""
        if not guided:
            return v
        g = self.groups
        if g.cfg_size > 1:
            both = torch.empty((2, *v.shape), dtype=v.dtype, device=v.device)
            comm.all_gather_into_tensor(both, v.contiguous(), g.cfg_group)
            v_cond, v_uncond = both.unbind(0)
        else:
            v_cond, v_uncond = v.chunk(2)
        return v_uncond + guidance * (v_cond - v_uncond)

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
                    f"rank {g.pipeline_ranks[stage]} (stage {stage}) posted (forward sends, forward receives, "
                    f"return sends, return receives) = {tuple(actual)}, but planned {tuple(planned)}"
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


# ---------------------------------------------------------------------------------------------------
# CFG parallel, and the one entry point infer.py uses.


def cfg_velocity(model, groups: SamplingGroups, y, y_mask, neg_y, neg_mask, guidance: float):
    """velocity(x, sigma) for RectifiedFlow.sample under cfg=2: this half of the ranks runs one branch
    (cfg rank 0 the conditional one, 1 the negative one: the serial batch order), and one all-gather per
    step brings both predictions to every rank, which all apply the guidance alike."""
    branch_y, branch_mask = (y, y_mask) if groups.cfg_rank == 0 else (neg_y, neg_mask)

    def velocity(x, sigma):
        v = model(x, sigma.expand(x.shape[0]), branch_y, branch_mask).contiguous()
        both = torch.empty((2, *v.shape), dtype=v.dtype, device=v.device)
        comm.all_gather_into_tensor(both, v, groups.cfg_group)
        v_cond, v_uncond = both.unbind(0)
        return v_uncond + guidance * (v_cond - v_uncond)

    return velocity


class ParallelSampler:
    """sampler(flow, noise, y, y_mask, neg_y, neg_mask, steps=, guidance=, progress=) -> latents on every
    rank of the replica, for models.pipeline.generate: PipeFusion when parallel.pipefusion > 1, else
    the serial loop with CFG parallel (ulysses/ring, if any, are inside `model` already)."""

    def __init__(self, model, groups: SamplingGroups, patches: int, warmup: int):
        self.groups = groups
        self.pipefusion = PipeFusionSampler(model, groups, patches, warmup) if groups.stages > 1 else None
        self.model = model

    def __call__(
        self, flow, noise, y, y_mask, neg_y=None, neg_mask=None, steps=30, guidance=1.0, progress=None
    ):
        if self.pipefusion is not None:
            return self.pipefusion.sample(
                flow, noise, y, y_mask, neg_y, neg_mask, steps=steps, guidance=guidance, progress=progress
            )
        velocity = None
        if self.groups.cfg_size > 1:
            velocity = cfg_velocity(self.model, self.groups, y, y_mask, neg_y, neg_mask, guidance)
        return flow.sample(
            self.model,
            noise,
            y,
            y_mask,
            neg_y,
            neg_mask,
            steps=steps,
            guidance=guidance,
            progress=progress,
            velocity=velocity,
        )
