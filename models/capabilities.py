"""What a family takes, declared in one object (Family.capabilities) that the code above models/ reads
instead of a family's name. Where a family lacks one, `reasons` gives the model's own reason, which its
refusal names (`refusal`); tests/test_families.py requires one for every capability a family lacks."""

from dataclasses import dataclass, field

# the degrees besides dp (which splits prompts and needs nothing of a family)
DEGREES = ("cfg", "ulysses", "ring", "pipefusion")


@dataclass(frozen=True)
class Capabilities:
    parallel: tuple = DEGREES  # the degrees its sampling runs under besides dp
    first_block: bool = True  # sample.cache=first_block, through its transformer's patch pieces
    calibrated_cache: bool = True  # sample.cache=calibrated (scripts/calibrate_cache.py calibrates its steps)
    tasks: tuple = ("t2v",)  # the model.task values it trains (its image-to-video comes from its folder)
    image_to_video: bool = False  # its image-to-video folders sample from infer.py --image (takes_images)
    trains_images: bool = False  # its image-to-video folders train (each clip's first frame given)
    trains_audio: bool = False  # its training reads the clips' sound (data.audio)
    samples_audio: bool = False  # it samples sound with the video (infer.py --no-audio leaves it out)
    # --image (and the previews' sample.images) are reference images, the same for every prompt
    # (Qwen-Image-Edit, FLUX.2), not each prompt's first frame; its training's at most this many a line
    references: bool = False
    max_references: int = 0
    expert_pair: bool = False  # a run trains one of two experts (model.expert), exported as one pipeline
    # its operators mask a split's or PipeFusion's padded keys through the recipe's kernel, so
    # model.attention_backend must take a mask there (False: they pick SDPA themselves where keys are masked)
    masks_through_kernel: bool = True
    # {capability (a field's name, or a degree of `parallel`): why the model does not take it; "tasks":
    # where its image-to-video training comes from instead of model.task}
    reasons: dict = field(default_factory=dict)

    def lacking(self) -> list:
        """The degrees and the sampling capabilities it does not take (each needs a reason)."""
        flags = ("first_block", "calibrated_cache")
        return [d for d in DEGREES if d not in self.parallel] + [f for f in flags if not getattr(self, f)]

    def refusal(self, names, what: str, title: str, instead: str = "") -> str:
        """The error for `what` (the user's words) asking `title` for the capabilities `names` (one, or a
        list) it lacks, each with its reason."""
        names = [names] if isinstance(names, str) else names
        reasons = "; ".join(dict.fromkeys(self.reasons.get(n, "it is not built for it yet") for n in names))
        return f"{what}: {title} does not take it ({reasons})" + (f": {instead}" if instead else "")
