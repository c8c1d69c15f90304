"""Weight files checked without loading them: a safetensors file against the length its header gives, a
folder's weight names against a model's parameters, and ComfyUI's checkpoint prefixes taken off a single
file's names. The ground floor of models/: Wan's reader (models/dit/wan.py), the families' (models/family.py
and their weights.py) and the LoRA formats use it.
"""

import json
from pathlib import Path


class WeightFileError(ValueError):
    """A weights file that is not what it says (a user error: the message names the file)."""


class LazyWeights:
    """What model.pretrained's weights are read through, whatever holds them: a diffusers folder (Wan's:
    models/dit/wan.py WanWeights; a family's: models/family.py FamilyWeights), read row by row so that each
    rank of a sharded model reads only its shard (parallel/build/init.py materialize), or a tessera run's
    checkpoint (parallel/build/components.py TesseraWeights), which DCP reads resharded. The code above
    models/ asks these methods, never the kind."""

    folder: Path  # what model.pretrained names, for messages
    checkpoint: Path | None = None  # a tessera checkpoint's step folder: read through DCP, not row by row
    use_ema: bool = True  # a checkpoint's: its EMA weights, or the raw ones

    def check_parameters(self, names, partial: bool = False) -> None:
        """Every weight has a place among the model's parameter `names` and every parameter a weight
        (`partial`, a PipeFusion stage holding some blocks: the latter only); else an error naming them."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple:
        raise NotImplementedError

    def read(self, name: str, start: int, stop: int):
        """Rows start:stop (along dim 0) of tessera parameter `name`, float32, reading only those bytes."""
        raise NotImplementedError

    def where(self, name: str) -> str:
        """Where parameter `name` (tessera's name) is read from, for a message: model.pretrained, the file
        and its key where the kind knows them."""
        return f"model.pretrained={self.folder}: tensor '{name}' (tessera's name)"


def check_safetensors(file: Path, what: str = "model.pretrained", error=WeightFileError) -> None:
    """A safetensors file holds an 8-byte header length, the JSON header, then the tensors' bytes: check
    that the file is as long as its header says (a download or copy cut short is not), reading a few KB."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, 100 << 20):
            raise error(
                f"{what}: {file} is not a safetensors file, or is truncated ({size} bytes, "
                f"too short for the header it announces)"
            )
        try:
            header = json.loads(f.read(length))
            end = max(
                (entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise error(f"{what}: {file} has a damaged safetensors header") from None
    if 8 + length + end > size:
        raise error(
            f"{what}: {file} is truncated: {size} bytes, its header describes "
            f"{8 + length + end} (an interrupted download or copy?)"
        )


def check_weight_names(folder, names, weights, partial: bool = False, error=ValueError) -> None:
    """Every weight of `folder` (`weights`: its names) has a place among the model's parameter `names`,
    and every parameter a weight; `partial` (a PipeFusion stage holds some blocks): the latter only."""
    ours, theirs = set(names), set(weights)
    if ours - theirs or (not partial and theirs - ours):
        raise error(
            f"model.pretrained={folder} does not fit the model: weights without a place "
            f"{sorted(theirs - ours)[:5] if not partial else []}, parameters without a weight "
            f"{sorted(ours - theirs)[:5]}"
        )


# ComfyUI's checkpoint prefixes of a single transformer file (its UNETLoader's files carry none)
COMFYUI_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def unprefixed(state_dict: dict, error=ValueError) -> dict:
    """A single file's state dict without ComfyUI's checkpoint prefix; two keys that then name one
    tensor are an `error` naming them."""
    out = {}
    for key, value in state_dict.items():
        name = next((key[len(p) :] for p in COMFYUI_PREFIXES if key.startswith(p)), key)
        if name in out:
            raise error(f"'{key}' and another key both name '{name}'")
        out[name] = value
    return out
