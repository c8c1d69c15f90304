"""LTX-2's recipe keys (models/recipe_keys.py): the guidance terms its pipeline adds. None: the pipeline's
default."""

from typing import Optional

from models.recipe_keys import RecipeKey

_TERM = dict(type=Optional[float], default=None, families=("ltx2",), what="guidance term")
KEYS = (
    RecipeKey("sample.audio_guidance", **_TERM),  # the pipeline's audio_guidance_scale (the sound's CFG)
    RecipeKey("sample.modality_guidance", **_TERM),  # modality_scale: each stream against it alone
    RecipeKey("sample.guidance_rescale", **_TERM),  # guidance_rescale, on both streams
    RecipeKey("sample.stg", **_TERM),  # stg_scale (0: no spatio-temporal guidance pass)
)
