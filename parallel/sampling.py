"""The sampler infer.py runs across a sampling layout (models.pipeline.generate's `sampler`): PipeFusion when
parallel.pipefusion > 1, else the serial loop with CFG parallel, with image-to-video's condition and Wan
2.2's two experts (ulysses/ring, if any, are inside the models already)."""

from models.flow import guided_velocity
from models.image_condition import ConditionedModel
from parallel.cfg import SamplingGroups, cfg_velocity
from parallel.pipefusion import PipeFusionSampler


class ParallelSampler:
    """sampler(flow, noise, y, y_mask, neg_y, neg_mask, steps=, guidance=, progress=) -> latents on every
    rank of the replica, for models.pipeline.generate: PipeFusion when parallel.pipefusion > 1, else
    the serial loop with CFG parallel (ulysses/ring, if any, are inside `model` already)."""

    def __init__(self, model, groups: SamplingGroups, patches: int, warmup: int, faults=None, experts=None):
        """`experts`: Wan 2.2 A14B's (low-noise model, boundary, guidance_2): `model` samples the steps
        whose noise level is at or above the boundary, the low-noise model the others at guidance_2."""
        self.groups, self.experts = groups, experts
        self.pipefusion = None
        if experts is not None and groups.stages > 1:
            raise ValueError("Wan 2.2's two experts do not run under PipeFusion yet")
        self.device = next(model.parameters()).device
        if groups.stages > 1:
            self.pipefusion = PipeFusionSampler(model, groups, patches, warmup, faults)
        self.model = model

    def __call__(
        self,
        flow,
        noise,
        y,
        y_mask,
        neg_y=None,
        neg_mask=None,
        steps=30,
        guidance=1.0,
        progress=None,
        condition=None,
    ):
        """`condition`: image-to-video's (models/image_condition.py), or None."""
        if self.pipefusion is not None:
            return self.pipefusion.sample(
                flow,
                noise,
                y,
                y_mask,
                neg_y,
                neg_mask,
                steps=steps,
                guidance=guidance,
                progress=progress,
                condition=condition,
            )

        def velocity_of(model, guidance):
            model = model if condition is None else ConditionedModel(model, condition)
            if self.groups.cfg_size > 1:
                return cfg_velocity(model, self.groups, y, y_mask, neg_y, neg_mask, guidance)
            return guided_velocity(model, y, y_mask, neg_y, neg_mask, guidance)

        velocity = high = velocity_of(self.model, guidance)
        if self.experts is not None:  # as diffusers: the high-noise expert while t >= boundary x 1000
            low_model, boundary, guidance_2 = self.experts
            low = velocity_of(low_model, guidance_2)

            def velocity(x, sigma):
                first = bool(sigma * 1000 >= boundary * 1000)
                self._on_device(*((self.model, low_model) if first else (low_model, self.model)))
                return (high if first else low)(x, sigma)

            self._on_device(self.model, low_model)  # a sampling starts with the high-noise expert
        return flow.sample(None, noise, y, y_mask, steps=steps, progress=progress, velocity=velocity)

    def _on_device(self, active, idle) -> None:
        """Wan 2.2's two experts: only the sampling one on the device (14B each); swapped once a sampling."""
        if next(active.parameters()).device != self.device:
            idle.to("cpu")
            active.to(self.device)
