"""How PipeFusion cuts the work (parallel/compute/pipefusion.py runs it): the DiT's blocks into contiguous
stages (`keep_blocks`), the tokens into patches of whole rows (`patch_ranges`), the steps into passes
(`schedule`), and what each rank sends and receives (`MessagePlan`), which the ranks of a pipeline
compare before the first message, so that a rank that would send one message too many or too few is
named instead of leaving its peer waiting.
"""

import copy
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel.compute.layout import LayoutError


class PipeFusionError(RuntimeError):
    """Ranks of a pipeline that disagree on their messages: reported as an `error:` line, no traceback."""


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


def keep_blocks(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """A copy of `model` (sharing its modules, not duplicating them) that holds only stage `stage`'s blocks:
    the others become DroppedBlocks, so the kept blocks keep their names (checkpoint keys, pretrained
    rows and per-parameter seeds address the same weights as in the whole model); `stage_range` names
    the kept ones. Works on a meta-device model, before any weight is allocated."""
    part = copy.copy(model)
    part._modules = dict(model._modules)  # noqa: SLF001  (a shallow copy must not share the module table)
    ranges = stage_blocks(len(model.blocks), stages)
    owner = {i: s for s, r in enumerate(ranges) for i in r}
    part.blocks = nn.ModuleList(
        [block if owner[i] == stage else DroppedBlock(i, owner[i]) for i, block in enumerate(model.blocks)]
    )
    part.stage_range = ranges[stage]
    return part


def held_elsewhere(part: nn.Module) -> tuple[str, ...]:
    """The module names of the whole model that another stage holds (keep_blocks left them out of `part`):
    a LoRA delta for one of them is that stage's to merge (models.lora.merge_deltas). () for a whole model."""
    return tuple(f"blocks.{block.index}" for block in part.blocks if isinstance(block, DroppedBlock))


# ---------------------------------------------------------------------------------------------------
# The message plan.


@dataclass(frozen=True)
class Item:
    """One pass through the stages: a step's whole sequence (warm-up) or one patch of it."""

    step: int
    start: int
    end: int


def schedule(
    steps: int, warmup: int, patches: list[tuple[int, int]], tokens: int, computed=None
) -> list[Item]:
    """The passes of `steps` steps; with a step cache (sample.cache=calibrated), of its `computed` steps
    alone: a skipped step runs on no stage and sends nothing. The warm-up is the first `warmup` steps that
    run."""
    items = []
    for index, step in enumerate(range(steps) if computed is None else computed):
        if index < warmup:
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
    computed: int  # which steps run (a checksum of their indices): the step cache's plan

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
    computed = sorted({item.step for item in items})
    return MessagePlan(
        forward_sends=0 if last else len(items),
        forward_recvs=0 if first else len(items),
        return_sends=returned if last else 0,
        return_recvs=returned if first else 0,
        steps=steps,
        warmup=warmup,
        patches=patches,
        tokens=tokens,
        computed=zlib.crc32(repr(computed).encode()),
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
    schedules = {(p.steps, p.warmup, p.patches, p.tokens, p.computed) for p in plans}
    if problems or len(schedules) > 1:
        described = "; ".join(
            f"rank {r}: steps={p.steps} warmup={p.warmup} patches={p.patches} tokens={p.tokens} "
            f"computed steps={p.computed:#010x}"
            for r, p in zip(pipeline_ranks, plans)
        )
        raise PipeFusionError(
            "PipeFusion message plans disagree"
            + (f": {'; '.join(problems)}" if problems else "")
            + f" ({described}); every rank must run the same command and recipe"
        )
