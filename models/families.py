"""The families tessera knows, by name (`model.family`), and which one a folder holds (model.size=auto).
A new family adds its module and class to FAMILIES; nothing else here changes."""

import importlib
from collections.abc import Mapping
from pathlib import Path

from models.family import Family, folder_classes


class Families(Mapping):
    """name -> the family's object, its module imported when the family is first asked for: importing
    every family cost each command about 4 s (LTX-2's brings diffusers' autoencoders, 3 s), a second of
    every one of the demo's start-ups on two cores. The modules are named as strings, so the import
    checks of tests/test_layers.py do not see these edges (they point down into models/ anyway)."""

    def __init__(self, where: dict[str, str]):
        self._where, self._loaded = where, {}

    def __getitem__(self, name: str) -> Family:
        if name not in self._loaded:
            module, cls = self._where[name].split(":")
            family = getattr(importlib.import_module(module), cls)()
            assert family.name == name, f"{cls}.name is {family.name!r}, registered as {name!r}"
            self._loaded[name] = family
        return self._loaded[name]

    def module(self, name: str) -> str:
        """The module that holds the family (without importing it)."""
        return self._where[name].split(":")[0]

    def __contains__(self, name) -> bool:  # without importing it
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


FAMILIES = Families(
    {
        "dit": "models.dit.family:DiTFamily",
        "qwen_image": "models.qwen_image.family:QwenImage",
        "qwen_image_edit": "models.qwen_image.edit:QwenImageEdit",
        "sana": "models.sana.family:Sana",
        "hunyuan_video15": "models.hunyuan_video15.family:HunyuanVideo15",
        "ltx2": "models.ltx2.family:LTX2",
        "z_image": "models.z_image.family:ZImage",
        "flux2": "models.flux2.family:Flux2",
        "flux2_dev": "models.flux2.family:Flux2Dev",
    }
)


def family_keys() -> tuple:
    """Every family's own recipe keys (models/recipe_keys.py): the KEYS of the keys.py beside each
    registered family's module, where there is one (imported alone: such a package keeps its __init__
    light)."""
    root = Path(__file__).resolve().parent.parent
    packages = dict.fromkeys(FAMILIES.module(name).rsplit(".", 1)[0] for name in FAMILIES)
    keys = ()
    for package in packages:
        if (root / package.replace(".", "/") / "keys.py").is_file():
            keys += importlib.import_module(f"{package}.keys").KEYS
    return keys


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r} is not a family tessera knows: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_folder(folder) -> Family | None:
    """The family whose diffusers classes `folder` declares, or None (a Wan-AI original folder, a tessera
    run, or a family tessera does not know: folder_classes says which)."""
    if not folder_classes(folder):  # a tessera run or a Wan-AI folder: no family module need load
        return None
    return next((family for family in FAMILIES.values() if family.recognises(folder)), None)
