"""LTX-2's recipe keys (models/recipe_keys.py): the guidance terms its pipeline adds (None: the pipeline's
default), a distillation's teacher's (None: the recipe's sample.<key>), and the share of training clips
given their first frame (Lightricks' trainer's spelling); the terms as the family reads them
(LTX2Guidance)."""

from dataclasses import dataclass, fields
from typing import Optional

from models.recipe_keys import RecipeKey

_TERM = dict(type=Optional[float], default=None, families=("ltx2",), what="guidance term")
KEYS = (
    RecipeKey("sample.audio_guidance", **_TERM),  # the pipeline's audio_guidance_scale (the sound's CFG)
    RecipeKey("sample.modality_guidance", **_TERM),  # modality_scale: each stream against it alone
    RecipeKey("sample.guidance_rescale", **_TERM),  # guidance_rescale, on both streams
    RecipeKey("sample.stg", **_TERM),  # stg_scale (0: no spatio-temporal guidance pass)
)
# train.objective=dmd: the teacher's terms (its student samples in one pass: models/ltx2/family.py)
KEYS += tuple(RecipeKey(f"distill.{k.name}", **_TERM) for k in KEYS)
# each training clip's chance to train image-to-video: its first latent frame given clean, at sigma 0 and out
# of the loss, as Lightricks' trainer does (its default 0.1; 0 here: a recipe trains as before it existed)
KEYS += (RecipeKey("train.first_frame_conditioning_p", float, 0.0, ("ltx2",), "image-to-video training key"),)


@dataclass(frozen=True)
class LTX2Guidance:
    """The pipeline's guidance terms besides the video's CFG scale (sample.guidance), its defaults: audio
    CFG (audio_guidance_scale), modality isolation (modality_scale), the rescale and STG (stg_scale), the
    last three the same for both streams (the pipeline's audio_* take the video's only when None: a call
    that sets the video's sets each audio_* too)."""

    audio_guidance: float = 7.0
    modality_guidance: float = 3.0
    guidance_rescale: float = 0.7
    stg: float = 1.0


def guidance_terms(section) -> LTX2Guidance:
    """A recipe section's audio_guidance, modality_guidance, guidance_rescale and stg (None: the pipeline's
    default): cfg.sample's, or a distillation's teacher's, cfg.distill's."""
    given = {f.name: section[f.name] for f in fields(LTX2Guidance) if section[f.name] is not None}
    return LTX2Guidance(**{k: float(v) for k, v in given.items()})
