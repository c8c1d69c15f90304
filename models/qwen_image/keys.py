"""Qwen-Image-Edit's recipe keys (models/recipe_keys.py)."""

from typing import Optional

from models.recipe_keys import RecipeKey

KEYS = (
    # the pixels each reference is sized to for the VAE, at its aspect ratio (its latents' tokens: the area
    # / 256); None: the pipeline's 1024 x 1024. Smaller references sample and train faster, as the
    # release was not trained to
    RecipeKey(
        "model.reference_area", Optional[int], None, ("qwen_image_edit",), "reference size",
        at_least=32 * 32, null="the pipeline's 1024 x 1024",
    ),
)  # fmt: skip
