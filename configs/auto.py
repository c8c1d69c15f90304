"""model.size=auto: every architecture key from model.pretrained's config, so one recipe serves any Wan
folder (Wan2.1 1.3B / 14B, I2V, FLF2V, Wan 2.2's experts). A key the recipe sets and the folder
contradicts stays an error naming the key."""

from pathlib import Path

from models.dit import ARCHITECTURE_OPTIONS, DIMENSIONS, DiT_models
from models.families import FAMILIES, family_of_folder
from models.family import folder_classes
from models.lora import DEFAULT_TARGETS


def resolve_family(cfg, error=ValueError) -> None:
    """Set cfg.model.family (auto: the family model.pretrained's folder declares under model.size=auto,
    else dit), and lora.targets' default to the family's layers. A folder of another family than the one
    asked, a family other than dit without model.size=auto, and a folder of a family tessera does not know
    are refused by name."""
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
    if not FAMILIES[wanted].native and mc.size != "auto":
        raise error(
            f"model.family={wanted} reads its dimensions from model.pretrained's folder: set model.size=auto "
            f"(got model.size={mc.size})"
        )
    mc.family = wanted
    if tuple(cfg.lora.targets) == DEFAULT_TARGETS:  # the DiT's layer names: the family's own instead
        cfg.lora.targets = list(FAMILIES[wanted].default_lora_targets(cfg) or DEFAULT_TARGETS)


def resolve_auto_size(cfg, error=ValueError) -> None:
    """Fill cfg.model from the Wan folder in model.pretrained: model.size (the named size with its depth,
    width and heads), the options, patch_size and task. `error`: the exception type to raise."""
    from models.wan import WanFormatError, WanWeights

    mc = cfg.model
    folder = mc.pretrained
    if not folder or not Path(folder).is_dir():
        raise error(f"model.size=auto reads the architecture from model.pretrained's folder: got {folder!r}")
    if not (Path(folder) / "config.json").is_file() and not (Path(folder) / "transformer").is_dir():
        raise error(
            f"model.size=auto reads a Wan folder's config.json; {folder} has none (a tessera run keeps "
            "its own recipe: name its model.size)"
        )
    try:
        found = WanWeights(folder).dit_kwargs
    except WanFormatError as e:
        raise error(f"model.size=auto: {e}") from None
    for key in DIMENSIONS:
        if mc[key] is not None and mc[key] != found[key]:
            raise error(f"model.{key}={mc[key]} contradicts {folder} ({found[key]}): drop it")
    sizes = [name for name, size in DiT_models.items() if all(size[k] == found[k] for k in DIMENSIONS)]
    if not sizes:  # a pruned, distilled or community variant: a Wan size's options, the folder's dimensions
        sizes = [name for name in DiT_models if name.startswith("Wan")]
        for key in DIMENSIONS:
            mc[key] = found[key]
    task = folder_task(folder, found, mc.task)
    settings = {k: found.get(k) for k in ARCHITECTURE_OPTIONS}
    if task == "flf2v" and found.get("image_positions"):  # the recipe counts one image's tokens
        settings["image_tokens"] = found["image_tokens"] // 2
    settings.pop("image_positions")  # model.task=flf2v sets it
    for key, value in settings.items():
        if value is None and key == "image_dim" and mc[key] is not None:
            raise error(f"model.image_dim={mc[key]} contradicts {folder} (no CLIP features): drop it")
        if value is None:
            continue
        if mc[key] is not None and mc[key] != value:
            raise error(
                f"model.{key}={mc[key]} contradicts {folder} ({value}): drop it, or use model.size=<a size>"
            )
        mc[key] = value
    defaults = {"task": "t2v", "patch_size": [1, 2, 2], "qk_norm": True, "rope_theta": 10000.0}
    wanted = {"task": task, "patch_size": list(found["patch_size"]), "qk_norm": True, "rope_theta": 10000.0}
    for key, value in wanted.items():
        ours = list(mc[key]) if key == "patch_size" else mc[key]
        if ours != defaults[key] and ours != value:
            raise error(
                f"model.{key}={ours} contradicts {folder} ({value}): drop it, or use model.size=<a size>"
            )
        mc[key] = value
    if mc.image_dim and mc.image_tokens is None:  # I2V's config does not say it: its CLIP encoder does
        mc.image_tokens = clip_tokens(cfg.image_encoder.pretrained or folder)
    mc.size = next((name for name in sizes if name.startswith("Wan")), sizes[0])


def folder_task(folder, found: dict, asked: str) -> str:
    """The task of the folder's transformer: the recipe's if the weights allow it (t2v weights serve
    ti2v; I2V weights without CLIP positions serve flf2v), else (and for t2v, the default, which a recipe
    cannot tell from unset) what the weights and model_index.json say."""
    import json

    if found["in_channels"] == found["out_channels"]:
        allowed = ["t2v", "ti2v"]
        index, config = Path(folder) / "model_index.json", Path(folder) / "config.json"
        if (index.is_file() and json.loads(index.read_text()).get("expand_timesteps")) or (
            config.is_file() and json.loads(config.read_text()).get("model_type") == "ti2v"
        ):
            allowed.reverse()  # Wan2.2 TI2V-5B's pipeline, or Wan-AI's own layout of it
    elif found.get("image_positions"):
        allowed = ["flf2v"]
    else:  # FLF2V without CLIP features needs no positions (Wan2.2-style weights)
        allowed = ["i2v", "flf2v"] if not found.get("image_dim") else ["i2v"]
    return asked if asked in allowed and asked != "t2v" else allowed[0]  # t2v: the default, or unset


def clip_tokens(folder):
    """Tokens per image of the CLIP encoder in `folder` (patches and the class token), or None (257)."""
    from models.image_condition import clip_vision_config, image_encoder_dirs

    try:
        config = clip_vision_config(image_encoder_dirs(folder)[0])
    except FileNotFoundError:
        return None
    return (config["image_size"] // config["patch_size"]) ** 2 + 1
