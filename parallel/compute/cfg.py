"""Sampling groups and classifier-free-guidance (CFG) parallelism: with `parallel.cfg=2` each half of
the ranks runs one guidance branch, and one all-gather per step (or per PipeFusion patch) brings both
predictions to every rank, which all apply the guidance alike.
"""

from dataclasses import dataclass

import torch

from models.sampler import serial_denoise
from parallel.compute import comm
from parallel.compute.sequence import SequenceGroups


@dataclass
class SamplingGroups:
    """This rank's place in the sampling layout (built by parallel/lifecycle/runtime.py)."""

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


def both_branches(v, groups: SamplingGroups) -> tuple:
    """(conditional, unconditional) under cfg=2, from this rank's branch `v` (a velocity, or its passes
    stacked: Steps.branch_passes) and one all-gather with the other half of the ranks (cfg rank 0 holds
    the conditional one)."""
    both = torch.empty((2, *v.shape), dtype=v.dtype, device=v.device)
    comm.all_gather_into_tensor(both, v.contiguous(), groups.cfg_group)
    return both.unbind(0)


def family_denoiser(groups: SamplingGroups):
    """models/sampler.py's `denoise_with` for a family (models/family.py) on this replica: under cfg=2 this
    half of the ranks runs one branch (cfg rank 0 the conditional one) and one all-gather a step brings
    the other; every rank then guides alike, whatever the step's scale. Otherwise both branches on this
    rank. Ulysses and ring, if any, are inside the model already."""

    def denoise_with(family, parts, schedule, noise, cond, uncond, scale: float, progress):
        if groups.cfg_size == 1 or uncond is None:
            return serial_denoise(family, parts, schedule, noise, cond, uncond, scale, progress)
        mine, conditional = (cond, True) if groups.cfg_rank == 0 else (uncond, False)

        def velocity(x, t):
            passes = family.steps.branch_passes(parts, x, t, mine, conditional)
            both = both_branches(passes, groups)
            step_scale = family.guidance.at(parts, t, scale)
            return family.steps.guide_passes(family.guidance, parts, x, t, *both, step_scale)

        return family.steps.walk(parts, schedule, noise, velocity, progress)

    return denoise_with
