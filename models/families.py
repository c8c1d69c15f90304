"""The families tessera knows, by name (`model.family`), and which one a folder holds (model.size=auto).
A new family adds its object to FAMILIES; nothing else here changes."""

from models.dit_family import DiTFamily
from models.family import Family
from models.hunyuan_video15.family import HunyuanVideo15
from models.ltx2.family import LTX2
from models.qwen_image.family import QwenImage
from models.sana.family import Sana

FAMILIES = {family.name: family for family in (DiTFamily(), QwenImage(), Sana(), HunyuanVideo15(), LTX2())}


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r} is not a family tessera knows: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def require_native(cfg, program: str) -> None:
    """Refuse (ValueError) a recipe of a family that `program` does not handle: it works on tessera's DiT."""
    family = family_named(cfg.model.family)
    if not family.native:
        raise ValueError(
            f"{program} works on tessera's DiT (Wan) recipes; {family.title} is sampled by infer.py"
        )


def family_of_folder(folder) -> Family | None:
    """The family whose diffusers classes `folder` declares, or None (a Wan-AI original folder, a tessera
    run, or a family tessera does not know: folder_classes says which)."""
    return next((family for family in FAMILIES.values() if family.recognises(folder)), None)
