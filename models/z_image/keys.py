"""Z-Image's recipe keys (models/recipe_keys.py): its pipeline's guidance terms. None: the pipeline's
default."""

from typing import Optional

from models.recipe_keys import RecipeKey

_TERM = dict(type=Optional[float], default=None, families=("z_image",), what="guidance term")
KEYS = (
    # cfg_truncation: a step whose 1 - sigma exceeds it runs the prompt alone (1 and above: never)
    RecipeKey("sample.cfg_truncation", **_TERM),
    # cfg_normalization as a factor: the guided velocity's norm capped at it times the prompt's (0: off)
    RecipeKey("sample.cfg_normalization", **_TERM),
)
