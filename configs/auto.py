"""model.family=auto and model.size=auto: the family model.pretrained's folder declares, and its
dimensions (Family.resolve_size: a Wan folder's architecture keys for tessera's DiT, models/dit/wan.py)."""

from pathlib import Path

from models.families import FAMILIES, family_of_folder
from models.family import folder_classes
from models.lora import DEFAULT_TARGETS


def resolve_family(cfg, error=ValueError) -> None:
    """Set cfg.model.family (auto: the family model.pretrained's folder declares under model.size=auto,
    else dit), and lora.targets' default to the family's layers. A folder of another family than the one
    asked, and a folder of a family tessera does not know, are refused by name (its size: load_config,
    through Family.resolve_size)."""
    mc = cfg.model
    if mc.family != "auto" and mc.family not in FAMILIES:
        raise error(f"'model.family' is {mc.family!r}; choose one of auto, {', '.join(FAMILIES)}")
    folder = mc.pretrained if mc.pretrained and Path(mc.pretrained).is_dir() else None
    found = family_of_folder(folder) if folder else None
    # what the folder declares (model_index.json, config.json, transformer/config.json): named when no
    # family claims it, rather than met as the first config key another family reads differently
    classes = " / ".join(sorted(folder_classes(folder))) if folder else ""
    if found is None and mc.size == "auto" and classes:
        raise error(
            f"model.pretrained={folder} holds a {classes}, a family tessera does not know; it knows "
            + "; ".join(f"{name} ({family.title})" for name, family in FAMILIES.items())
        )
    wanted = mc.family if mc.family != "auto" else (found.name if found and mc.size == "auto" else "dit")
    if found is not None and found.name != wanted:
        fix = "model.size=auto" + (f" model.family={found.name}" if mc.family != "auto" else "")
        raise error(
            f"model.pretrained={folder} holds {found.title}, but the recipe builds "
            f"{FAMILIES[wanted].title} (model.family={mc.family}, model.size={mc.size}): set {fix}"
        )
    mc.family = wanted
    if tuple(cfg.lora.targets) == DEFAULT_TARGETS:  # the DiT's layer names: the family's own instead
        cfg.lora.targets = list(FAMILIES[wanted].default_lora_targets(cfg) or DEFAULT_TARGETS)
