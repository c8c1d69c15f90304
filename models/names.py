"""A family's state-dict adapter (Family.names): its transformer's weight names as tessera's modules, its
diffusers folder and its original release (and ComfyUI's files) spell them, and how its LoRA files are
written. One declared object per family, as torchtitan's state-dict adapters; models/family.py's
loading, single files, LoRA reading and export go through it."""

import re
from collections.abc import Callable
from dataclasses import dataclass


def renamed(prefix: str, to: str) -> Callable:
    """A state dict's names with the leading `prefix` as `to`; every other name the same."""
    pattern = re.compile("^" + re.escape(prefix))
    return lambda state: {pattern.sub(to, key): value for key, value in state.items()}


def same(state: dict) -> dict:
    """A release that keeps diffusers' names."""
    return state


@dataclass(frozen=True)
class Names:
    # a diffusers state dict under the transformer's own names, and back (each a whole state dict: some
    # families count blocks in it)
    to_tessera: Callable = renamed("transformer_blocks.", "blocks.")  # diffusers' blocks are tessera's
    to_diffusers: Callable = renamed("blocks.", "transformer_blocks.")
    # a single file's state dict (the original release's names, ComfyUI's prefix) under diffusers', and
    # back: with it LoRA files in the release's names are read (models/lora_formats.py with_release_names)
    from_original: Callable = same
    to_original: Callable = same
    lora_formats: tuple = ("diffusers",)  # the key formats scripts/export.py writes its LoRAs in
    lora_alphas: bool = True  # its ComfyUI LoRAs carry an alpha per module (else the scale is in B)
    lora_release_names: bool = False  # its ComfyUI LoRAs are in the release's names (else diffusers' there)
    # from_original only renames (and drops) keys, each value passed through as it is: a single file is
    # then read lazily, each rank its own rows (else whole: a conversion that fuses or splits tensors)
    renames_only: bool = False

    @property
    def lazy_files(self) -> bool:
        """Whether a single file's tensors can be read by name (from_original renames them, or is `same`)."""
        return self.renames_only or self.from_original is same

    def diffusers_name(self, name: str) -> str:
        """A module's diffusers name (what LoRA files say)."""
        return next(iter(self.to_diffusers({name: None})))
