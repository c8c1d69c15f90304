"""How a family samples, step by step (Family.steps), declared as one object that every sampler calls (one
process, CFG parallel, PipeFusion, the step caches, the distillation): each sample's noise, the schedule
and the walk along it, a step's velocity with and without guidance, the patch pieces PipeFusion and the
first-block cache run, and the decoding. `parts` is what the family loaded (models/family.py Components);
`guidance` is the family's (models/guidance.py). A family subclasses it beside its own code."""

import contextlib

import torch

from models.loop import Schedule


def seeded_noise(seeds: list, shape: tuple, dtype=None) -> torch.Tensor:
    """(B, *shape): sample i's noise from a CPU generator seeded with seeds[i] alone, as pipelines draw it."""
    draw = lambda s: torch.randn(shape, generator=torch.Generator().manual_seed(s), dtype=dtype)  # noqa: E731
    return torch.stack([draw(s) for s in seeds])


class Steps:
    def noise(self, parts, seeds: list, frames: int, height: int, width: int) -> torch.Tensor:
        """The noise of each sample (B, C, T, h, w), sample i's drawn from seeds[i] alone, as its pipeline."""
        raise NotImplementedError

    def schedule(self, parts, steps: int, latents: torch.Tensor) -> Schedule:
        """Its pipeline's noise levels and solver for `steps` steps of `latents`."""
        raise NotImplementedError

    def context(self, parts):
        """The context the schedule is walked in (tessera's DiT: its autocast)."""
        return contextlib.nullcontext()

    def walk(self, parts, schedule: Schedule, noise, velocity, progress=None):
        """The latents at the schedule's end: models/loop.py's loop behind the step cache (parts.cache)."""
        from models.step_cache import walk_cached

        return walk_cached(parts.cache, schedule, noise, velocity, progress)[0]

    def velocity(self, parts, x, t, cond):
        """The conditional velocity alone (a sampling without guidance)."""
        return self.prediction(self.outputs(parts, x, t, cond)[0])

    def both(self, parts, x, t, cond, uncond) -> tuple:
        """(conditional, unconditional) velocities on one process (a family may run them as one batch)."""
        return tuple(self.prediction(v) for v in self.outputs(parts, x, t, cond, uncond))

    def guided(self, guidance, parts, x, t, cond, uncond, scale: float):
        """The guided velocity at `scale`, both branches on this process (a family whose step is more passes
        than two guides them here)."""
        return guidance.guide(*self.both(parts, x, t, cond, uncond), scale, parts)

    def branch_passes(self, parts, x, t, cond, conditional: bool) -> torch.Tensor:
        """CFG parallelism's share of a step (parallel/compute/cfg.py): the passes of one guidance branch,
        stacked (P, ...), P alike on both branches; `guide_passes` takes both back. Its velocity."""
        return self.velocity(parts, x, t, cond)[None]

    def guide_passes(self, guidance, parts, x, t, conditional, unconditional, scale: float):
        """The guided velocity from both branches' `branch_passes`."""
        return guidance.guide(conditional[0], unconditional[0], scale, parts)

    def outputs(self, parts, x, t, *conds) -> list:
        """The transformer's output for each conditioning, one call each; with sample.cache=first_block
        through models/step_cache.py FirstBlockFamily, which decides for all of them at once."""
        from models.step_cache import FirstBlockFamily

        t, cache = t.to(x.device).expand(x.shape[0]), parts.cache
        if cache is not None and cache.method == "first_block":
            return FirstBlockFamily(self.patch_pieces(parts, conds[0]), cache)(x, t, *conds)
        return [parts.transformer(x, t, cond) for cond in conds]

    def patch_pieces(self, parts, cond=None):
        """The transformer's patch pieces (embed, patch_context, companion, patch_blocks, patch_final,
        unpatchify) as this sampling of `cond` (any branch's conditioning: what the embedding reads is
        alike in each) calls them: PipeFusion's (parallel/compute/pipefusion.py), the first-block cache's."""
        return parts.transformer

    def prediction(self, v):
        """The transformer's output as the family's solver and guidance take it (its pipeline's dtype)."""
        return v

    def finish(self, parts, latents):
        """The denoised latents as they are decoded (Wan2.2 TI2V puts its given first frame back)."""
        return latents

    def decode(self, parts, latents) -> torch.Tensor:
        """The images (B, 3, T, H, W) in [-1, 1] of the denoised latents."""
        raise NotImplementedError

    def decode_audio(self, parts, latents) -> tuple | None:
        """(waveforms (B, channels, samples) float32 in [-1, 1], sample rate) of a family that samples sound
        with its video (LTX-2), else None."""
        return None
