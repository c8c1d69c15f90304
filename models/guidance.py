"""How a family guides its sampling (Family.guidance), declared as one object that every sampler calls
(one process, CFG parallel, PipeFusion, the distillation's teacher): whether a scale guides, the scale of
a step, and the guided velocity from the branches' velocities. The default is classifier-free guidance
as most pipelines write it, above a scale of 1; a family subclasses it where its pipeline differs."""


class Guidance:
    unguided = 1.0  # the guidance scale that samples without guidance (its pipeline's: `guided` is False)
    # ((sample.<key>, value), ...): the family's other guidance terms at which a step is one pass, as a
    # distilled student samples (parallel/drive/distill.py distilled_recipe keeps the recipe's values in
    # distill.<key> for the teacher)
    student_terms: tuple = ()

    def guided(self, scale: float) -> bool:
        """Whether `scale` asks for guidance (the pipelines guide above 1 only)."""
        return scale > 1.0

    def at(self, parts, t, scale: float) -> float:
        """The guidance scale of the step at timestep `t` (Wan 2.2's experts each have their own)."""
        return scale

    def guide(self, v_cond, v_uncond, scale: float, parts=None):
        """The guided velocity at `scale` (`parts`: what else the sampling set, Z-Image's normalisation)."""
        return v_uncond + scale * (v_cond - v_uncond)


class Unguided(Guidance):
    """A guidance-distilled model: the scale is its transformer's input, never a second branch."""

    def guided(self, scale: float) -> bool:
        return False
