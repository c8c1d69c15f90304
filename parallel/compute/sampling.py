"""The walk of the schedule infer.py runs for tessera's DiT across a sampling layout (models/sampler.py's
`denoise_with`, passed to models.dit.pipeline.generate as `sampler`): PipeFusion when parallel.pipefusion > 1,
else the family's loop with the guidance branches split under cfg=2 (parallel/compute/cfg.py, as every
family), with Wan 2.2's two experts taking turns (ulysses/ring, if any, are inside the models already)."""

from dataclasses import replace

from models.dit.family import Experts
from parallel.compute.cfg import SamplingGroups, family_denoiser
from parallel.compute.pipefusion import PipeFusionSampler


class ParallelSampler:
    """sampler(family, parts, schedule, noise, cond, uncond, scale, progress) -> latents on every rank of
    the replica."""

    def __init__(self, model, groups: SamplingGroups, patches: int, warmup: int, faults=None, experts=None):
        """`experts`: Wan 2.2 A14B's (low-noise model, boundary, guidance_2): `model` samples the steps
        whose noise level is at or above the boundary, the low-noise model the others at guidance_2."""
        self.experts = None if experts is None else Experts(*experts)
        self.pipefusion = None
        if experts is not None and groups.stages > 1:
            raise ValueError("Wan 2.2's two experts do not run under PipeFusion yet")
        if groups.stages > 1:
            self.pipefusion = PipeFusionSampler(model, groups, patches, warmup, faults)
        self.denoise = family_denoiser(groups)

    def __call__(self, family, parts, schedule, noise, cond, uncond, scale: float, progress=None):
        if self.pipefusion is not None:
            neg = (None, None) if uncond is None else (uncond.text, uncond.text_mask)
            return self.pipefusion.sample(
                parts.flow,
                schedule.sigmas,  # the schedule it is handed, not one of its own
                noise,
                cond.text,
                cond.text_mask,
                *neg,
                guidance=scale,
                progress=progress,
                condition=parts.condition,
            )
        if self.experts is not None:  # a sampling starts with the high-noise expert
            Experts.on_device(parts.transformer, self.experts.low, parts.device)
        parts = replace(parts, experts=self.experts)
        return self.denoise(family, parts, schedule, noise, cond, uncond, scale, progress)
