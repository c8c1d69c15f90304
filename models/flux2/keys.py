"""FLUX.2's recipe keys (models/recipe_keys.py)."""

from typing import Optional

from models.recipe_keys import RecipeKey

KEYS = (
    # the guidance scale a guidance-distilled transformer (FLUX.2 dev: its input, no CFG batch) is given in
    # training; None: its family's (FLUX.2 dev: 3.5, diffusers' train_dreambooth_lora_flux2.py's)
    RecipeKey(
        "train.guidance", Optional[float], None, ("flux2_dev",),
        "guidance scale input (a guidance-distilled transformer's; the others learn guidance from "
        "train.text_dropout's empty prompts)",
    ),
)  # fmt: skip
