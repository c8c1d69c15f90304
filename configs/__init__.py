"""Recipes: schema defaults <- YAML recipe <- command-line dot-list, with errors that name the key.

cfg = load_config("configs/demo.yaml", ["train.max_steps=10"])
cfg.train.max_steps  # 10
"""

import dataclasses
import difflib
import math
import os
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configs.schema import FAMILY_KEYS, TesseraConfig
from models.tiling import check_tiling

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_RECIPE = CONFIG_DIR / "demo.yaml"


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


def _schema_keys(cls, prefix="") -> dict[str, type]:
    """Every dotted key of the schema with its declared type, e.g. {'train.max_steps': int}."""
    keys = {}
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys[name] = f.type
        if dataclasses.is_dataclass(f.type):
            keys.update(_schema_keys(f.type, name + "."))
    return keys


SCHEMA_KEYS = _schema_keys(TesseraConfig)


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "a section (mapping)"
    return getattr(tp, "__name__", str(tp))


def _closest(key: str) -> str:
    match = difflib.get_close_matches(key, SCHEMA_KEYS, n=1, cutoff=0.5)
    if not match:  # compare the last part alone: 'max_step' -> 'train.max_steps'
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in SCHEMA_KEYS}
        close = difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.6)
        match = [leaves[close[0]]] if close else []
    return f"; did you mean '{match[0]}'?" if match else ""


def _check_keys(node, prefix: str, source: str) -> None:
    """Reject keys the schema does not declare, before OmegaConf merges anything."""
    if not isinstance(node, (dict, DictConfig)):
        return
    for key in node:
        full = f"{prefix}{key}"
        value = node[key]
        if full not in SCHEMA_KEYS:
            while isinstance(value, (dict, DictConfig)) and len(
                value
            ):  # a misspelt section: name a whole key
                sub = next(iter(value))
                full, value = f"{full}.{sub}", value[sub]
            raise ConfigError(f"unknown key '{full}' in {source}{_closest(full)}")
        if dataclasses.is_dataclass(SCHEMA_KEYS[full]):
            if not isinstance(value, (dict, DictConfig)):
                raise ConfigError(f"'{full}' in {source} must be a section (mapping), got {value!r}")
            _check_keys(value, full + ".", source)


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(
                f"override '{item}' is not of the form key=value (for example train.max_steps=100)"
            )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"could not parse the command-line overrides {overrides}: {e}") from None


def load_config(recipe: str | os.PathLike | None = None, overrides: list[str] | tuple = ()) -> DictConfig:
    """Merge schema defaults, the recipe (default: configs/demo.yaml) and dot-list overrides."""
    recipe = Path(recipe) if recipe is not None else DEFAULT_RECIPE
    layers = _recipe_layers(recipe, [])
    cli_cfg = _parse_overrides(list(overrides))
    _check_keys(cli_cfg, "", "the command-line overrides")
    _refuse_environment(cli_cfg, "the command-line overrides")

    cfg = OmegaConf.structured(TesseraConfig)
    for source, layer in (*layers, ("the command-line overrides", cli_cfg)):
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            expected = _type_name(SCHEMA_KEYS.get(key, object))
            value = OmegaConf.select(layer, key, default="?") if key != "?" else "?"
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value)
            raise ConfigError(f"'{key}' in {source} must be {expected}, got {value!r}") from None
    from configs.auto import resolve_family
    from models.families import family_named

    resolve_family(cfg, ConfigError)
    family = family_named(cfg.model.family)
    # the default recipe's keys (the demo's DiT's) are not the user's: model.size=auto on a folder drops them
    given = [layer for _, layer in layers] if recipe.resolve() != DEFAULT_RECIPE.resolve() else []
    _other_families_keys(cfg, family, [*given, cli_cfg])
    try:
        family.resolve_size(cfg, ConfigError)  # auto: the folder's; or refused by name
    except ConfigError as e:
        if given:
            raise
        raise ConfigError(  # the demo's keys contradict a folder of the family they belong to (Wan's)
            f"{e} (set by the default recipe, configs/demo.yaml: name a recipe of {family.title} with "
            "--config)"
        ) from None
    validate(cfg)
    _check_decay_fraction(cli_cfg, cfg)
    _check_memory_choice(cli_cfg, cfg)
    return cfg


def _other_families_keys(cfg, family, given: list) -> None:
    """A family's own key (models/<family>/keys.py) set to other than its default under a family that does
    not read it: refused by name where the user set it (in one of the `given` layers), rather than ignored;
    else (the default recipe's) put back to its default, so that the run's config.yaml holds none."""
    from models.families import FAMILIES

    for k in FAMILY_KEYS:
        value = OmegaConf.select(cfg, k.key)
        if family.name in k.families or value == k.default:
            continue
        if all(OmegaConf.select(layer, k.key, default=None) is None for layer in given):
            OmegaConf.update(cfg, k.key, list(k.default) if isinstance(k.default, list) else k.default)
            continue
        if isinstance(value, ListConfig):
            value = OmegaConf.to_container(value)
        owners = " and ".join(FAMILIES[name].title for name in k.families)
        raise ConfigError(
            f"{k.key}={value}: {family.title} takes no such {k.what}; it belongs to {owners} "
            f"(models/{FAMILIES.module(k.families[0]).split('.')[1]}/keys.py): unset it"
        )


def _recipe_layers(recipe: Path, seen: list) -> list[tuple[str, DictConfig]]:
    """[(source, layer)] of a recipe, its `base:` recipes first (a path relative to the recipe's folder:
    the card recipes are a few keys on top of a family's), each checked against the schema."""
    if not recipe.is_file():
        raise ConfigError(f"recipe '{recipe}' does not exist (recipes live in {CONFIG_DIR})")
    if recipe.resolve() in seen:
        chain = " -> ".join(str(p) for p in [*seen, recipe.resolve()])
        raise ConfigError(f"recipe '{recipe}' is its own base ({chain}): remove a `base:` line")
    try:
        layer = OmegaConf.load(recipe)
    except Exception as e:  # YAML syntax errors
        raise ConfigError(f"could not read recipe '{recipe}': {e}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"recipe '{recipe}' must be a mapping of sections, not {type(layer).__name__}")
    base = layer.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"'base' in recipe '{recipe}' must be the path of another recipe, got {base!r}")
    source = f"recipe '{recipe}'"
    _check_keys(layer, "", source)
    _refuse_environment(layer, source)
    under = _recipe_layers(recipe.parent / base, [*seen, recipe.resolve()]) if base else []
    return [*under, (source, layer)]


_ENVIRONMENT = re.compile(r"\$\{\s*oc\.env\s*:")


def _refuse_environment(layer, source: str) -> None:
    """An `${oc.env:VAR}` interpolation is refused: the resolved recipe is what config.yaml and W&B record,
    so a shared recipe would copy the user's environment (a token, a private path) into files they share."""

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}{key}.")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{prefix}{i}.")
        elif isinstance(node, str) and _ENVIRONMENT.search(node):
            yield prefix[:-1], node

    for key, value in walk(OmegaConf.to_container(layer, resolve=False), ""):
        raise ConfigError(
            f"'{key}: {value}' in {source} reads the environment (oc.env): the resolved value would be "
            "written into the run's config.yaml and W&B, so a shared recipe would copy a user's variables "
            "(tokens, private paths) into files they share. Write the value itself, or give it on the "
            f"command line ({key}=...; the shell expands $VAR there, as the user chose)"
        )


def _check_decay_fraction(cli_cfg, cfg) -> None:
    """train.decay_fraction shapes train.lr_decay=linear alone: asked for on the command line where lr_decay
    is another, it would do nothing. Recipes are not checked: a run's config.yaml holds every key."""
    if cfg.train.lr_decay != "linear" and OmegaConf.select(cli_cfg, "train.decay_fraction") is not None:
        raise ConfigError(
            f"train.decay_fraction={cfg.train.decay_fraction} on the command line shapes "
            f"train.lr_decay=linear only, and lr_decay is '{cfg.train.lr_decay}': add train.lr_decay=linear, "
            "or leave it out"
        )


# what train.memory=auto sets
MEMORY_KEYS = ("activation_checkpointing", "checkpoint_policy", "cpu_offload", "activation_offload")


def _check_memory_choice(cli_cfg, cfg) -> None:
    """train.memory=auto chooses MEMORY_KEYS from the start-up memory model: refused beside
    train.memory_check=false (no model), and beside one of them on the command line (never silently
    replaced)."""
    if cfg.train.memory != "auto":
        return
    if not cfg.train.memory_check:
        raise ConfigError(
            "train.memory=auto chooses from the start-up memory model, which train.memory_check=false turns "
            "off: set train.memory=manual, or train.memory_check=true"
        )
    given = [f"train.{k}" for k in MEMORY_KEYS if OmegaConf.select(cli_cfg, f"train.{k}") is not None]
    if given:
        raise ConfigError(
            f"train.memory=auto chooses {', '.join(given)} itself: drop {' '.join(given)} from the command "
            "line, or add train.memory=manual to use them"
        )


CHOICES = {
    "model.attention_backend": ("sdpa", "math", "xformers", "flash", "auto"),
    "model.base_dtype": ("auto", "float8"),
    "vae.kind": ("identity", "kl", "wan"),
    "text_encoder.kind": ("t5", "umt5", "clip"),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.lr_decay": ("constant", "cosine", "linear"),
    "train.on_nonfinite": ("stop", "skip"),
    "train.objective": ("flow", "dmd"),
    "train.checkpoint_policy": ("all", "selective"),
    "train.memory": ("manual", "auto"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
    "data.epoch_remainder": ("pad", "drop"),
    "data.on_plan_change": ("error", "new_epoch"),
    "sample.cache": ("none", "calibrated", "first_block"),
    "model.task": ("t2v", "i2v", "flf2v", "ti2v"),
    **{k.key: k.choices for k in FAMILY_KEYS if k.choices},  # a family's own (models/<family>/keys.py)
}


def _holds_floats(tp) -> bool:
    """float, Optional[float] or list[float]."""
    return tp is float or float in typing.get_args(tp)


# Bounds of single values, by kind of bound (the message says which); None where null means a default.
AT_LEAST_ONE = (
    "data.frames", "data.height", "data.width", "train.batch_size", "train.log_every",
    "train.checkpoint_every", "sample.steps", "text_encoder.max_length", "train.keep_checkpoints",
    "train.fp8_min_features", "distill.steps", "distill.critic_updates",
)  # fmt: skip
POSITIVE = (
    "train.lr", "train.grad_clip", "train.loss_limit", "train.weight_limit", "flow.shift",
    "parallel.timeout_s", "parallel.preflight_timeout_s", "parallel.control_timeout_s",
    "parallel.max_message_mb", "parallel.heartbeat_timeout_s", "sample.fps", "text_encoder.cache_size",
    "model.mlp_ratio", "model.rope_theta", "flow.logit_std",
)  # fmt: skip
NON_NEGATIVE = (
    "train.max_steps", "train.warmup_steps", "train.sample_every", "data.num_workers",
    "data.tokens_per_batch", "data.max_batch_size", "train.weight_decay", "parallel.pipefusion_warmup",
)  # fmt: skip
FRACTIONS = ("train.text_dropout", "train.ema_decay", "lora.dropout")  # in [0, 1)
SHARES = ("train.decay_fraction",)  # in (0, 1]
NULL_OR = {  # key: (its least value, what null means)
    "parallel.pipefusion_patches": (1, "one per stage"),
    "parallel.stall_timeout_s": (0, "the default for the device"),
    "data.fps": (0, "keep the file's rate"),
    "lora.alpha": (0, "alpha = rank"),
    "distill.critic_lr": (0, "train.lr"),
    "distill.shift": (0, "training's shift"),
    "distill.guidance": (0, "sample.guidance"),
    **{k.key: (k.at_least, k.null) for k in FAMILY_KEYS if k.at_least is not None},
}


def validate(cfg: DictConfig) -> None:
    """Checks of values that types alone cannot express."""
    _check_values(cfg)
    _check_sampling(cfg)
    _check_model(cfg)
    _check_distill(cfg)
    _check_lora(cfg)


def _check_values(cfg: DictConfig) -> None:
    """Finite numbers, choices, and the bounds of single values (the tables above)."""
    for key, tp in SCHEMA_KEYS.items():  # nan and inf parse as floats; no key means them
        if _holds_floats(tp):
            value = OmegaConf.select(cfg, key)
            for v in value if isinstance(value, ListConfig) else [value]:
                if v is not None and not math.isfinite(v):
                    raise ConfigError(f"'{key}' must be a finite number, got {v}")
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"'{key}' is {value!r}; choose one of {', '.join(allowed)}")
    if cfg.train.checkpoint_policy != "all" and not cfg.train.activation_checkpointing:
        raise ConfigError(
            f"train.checkpoint_policy={cfg.train.checkpoint_policy} says what checkpointed blocks recompute: "
            "set train.activation_checkpointing=true too"
        )
    if cfg.train.activation_offload and (
        not cfg.train.activation_checkpointing or cfg.train.checkpoint_policy != "all"
    ):
        raise ConfigError(
            "train.activation_offload moves the checkpointed blocks' inputs to host memory: it takes "
            "train.activation_checkpointing=true with train.checkpoint_policy=all (unchecked blocks, or "
            "selective's kept outputs, would all be copied out and back)"
        )
    if cfg.train.checkpoint_policy == "selective" and cfg.model.attention_backend not in ("sdpa", "math"):
        raise ConfigError(
            f"train.checkpoint_policy=selective keeps torch's attention outputs, not "
            f"model.attention_backend={cfg.model.attention_backend}'s (it would recompute them): use sdpa"
        )
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    for keys, wrong, bound in (
        (AT_LEAST_ONE, lambda v: v < 1, "at least 1"),
        (POSITIVE, lambda v: v <= 0, "greater than 0"),
        (NON_NEGATIVE, lambda v: v < 0, "0 or more"),
        (FRACTIONS, lambda v: not 0.0 <= v < 1.0, "in [0, 1)"),
        (SHARES, lambda v: not 0.0 < v <= 1.0, "in (0, 1]"),
    ):
        for key in keys:
            if wrong(get(key)):
                raise ConfigError(f"'{key}' must be {bound}, got {get(key)}")
    for key, (least, null) in NULL_OR.items():
        value = get(key)
        if value is not None and (value < least if least else value <= 0):
            bound = f"at least {least}" if least else "greater than 0"
            raise ConfigError(f"'{key}' must be {bound} or null ({null}), got {value}")
    for key in ("data.resolutions", "data.frame_counts"):
        if any(v < 1 for v in get(key)):
            raise ConfigError(f"'{key}' must hold positive numbers, got {list(get(key))}")
    if not 0.0 <= cfg.data.max_missing_fraction <= 1.0:  # checked with the recipe, not with the manifest
        raise ConfigError(
            f"'data.max_missing_fraction' must be in [0, 1], got {cfg.data.max_missing_fraction}"
        )
    if cfg.flow.shift_reference_tokens < 0:
        raise ConfigError(
            f"'flow.shift_reference_tokens' must be greater than 0, or 0 for a fixed shift (Wan's), "
            f"got {cfg.flow.shift_reference_tokens}"
        )
    if cfg.data.max_upscale < 1.0:
        raise ConfigError(
            f"'data.max_upscale' must be at least 1.0 (1.0: never enlarge), got {cfg.data.max_upscale}"
        )
    if len(cfg.train.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.train.betas):
        raise ConfigError(f"'train.betas' must be two numbers in [0, 1), got {list(cfg.train.betas)}")
    for ratio in cfg.data.aspect_ratios:
        try:
            parse_aspect_ratio(ratio)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_sampling(cfg: DictConfig) -> None:
    """The VAE tiles, and the step cache's settings and layouts."""
    try:
        check_tiling(cfg.vae.tile_latent, cfg.vae.tile_overlap)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sc = cfg.sample
    if sc.cache == "calibrated" and not sc.cache_calibration:
        raise ConfigError(
            f"sample.cache={sc.cache} needs sample.cache_calibration: write one with python "
            "scripts/calibrate_cache.py --config <recipe> --output cache.json (or set sample.cache=none)"
        )
    if sc.cache == "first_block" and (cfg.parallel.pipefusion or 1) > 1:
        raise ConfigError(first_block_under_pipefusion(cfg.parallel.pipefusion))
    if sc.cache_threshold <= 0 or sc.cache_first_block_threshold <= 0 or sc.cache_max_skips < 1:
        raise ConfigError(
            "sample.cache_threshold and sample.cache_first_block_threshold must be > 0 and "
            f"sample.cache_max_skips >= 1, got {sc.cache_threshold}, {sc.cache_first_block_threshold} and "
            f"{sc.cache_max_skips}"
        )


def _check_model(cfg: DictConfig) -> None:
    """The DiT's size, task and patch."""
    from models.dit.transformer import DiT_models  # light import: the model code needs only torch

    mc = cfg.model
    if mc.task in ("t2v", "ti2v") and mc.image_dim:
        raise ConfigError(
            f"model.image_dim={mc.image_dim} is image-to-video's: set model.task=i2v or flf2v, or "
            "model.image_dim=null"
        )
    pooled = mc.pooled_text
    if pooled is None:  # the size's choice, else the DiT's default
        pooled = DiT_models.get(mc.size, {}).get("pooled_text", True)
    if mc.task == "ti2v" and (mc.patch_size[:1] != [1] or pooled):
        raise ConfigError(
            "model.task=ti2v gives the first latent frame's tokens t = 0: it needs a time patch of 1 "
            f"(model.patch_size, got {list(mc.patch_size)}) and model.pooled_text=false (Wan's)"
        )
    if len(mc.patch_size) != 3 or min(mc.patch_size) < 1:
        raise ConfigError(
            "'model.patch_size' must be three positive sizes (time, height, width), "
            f"got {list(mc.patch_size)}"
        )
    from models.families import family_named

    family_named(mc.family).check_size_keys(mc, ConfigError)  # tessera's DiT: its named sizes


def _check_distill(cfg: DictConfig) -> None:
    """train.objective=dmd: a teacher (model.pretrained), a float8 teacher only under adapters (full copies,
    lora.rank=0, are trained in the compute dtype), and a range of noise levels (docs/distill.md)."""
    dc = cfg.distill
    if not 0.0 <= dc.min_sigma < dc.max_sigma <= 1.0:
        raise ConfigError(
            f"distill.min_sigma={dc.min_sigma} and distill.max_sigma={dc.max_sigma}: the matching loss's "
            "noise levels need 0 <= min_sigma < max_sigma <= 1"
        )
    if cfg.train.objective != "dmd":
        return
    if not cfg.model.pretrained:
        raise ConfigError(
            "train.objective=dmd distils model.pretrained (the teacher), which is not set: name the model to "
            "distil (a diffusers folder, a single file or a tessera run)"
        )
    if not cfg.lora.rank and cfg.model.base_dtype != "auto":
        raise ConfigError(
            f"train.objective=dmd with lora.rank=0 trains full copies of the student and the critic, and "
            f"model.base_dtype={cfg.model.base_dtype} stores a frozen base: set lora.rank for two LoRAs on a "
            "float8 teacher, or model.base_dtype=auto"
        )
    if cfg.lora.init_from:
        raise ConfigError(
            f"train.objective=dmd with lora.init_from={cfg.lora.init_from}: the student would start from "
            "that LoRA while its critic and teacher are the bare base; distil the base with it merged (a "
            "tessera LoRA run: scripts/export.py --lora --merge) as model.pretrained"
        )


def _check_lora(cfg: DictConfig) -> None:
    lora = cfg.lora
    if lora.rank < 0:
        raise ConfigError(f"'lora.rank' must be 0 (full fine-tuning) or more, got {lora.rank}")
    if lora.rank and lora.dropout > 0 and cfg.train.activation_checkpointing:
        raise ConfigError(
            "lora.dropout > 0 with train.activation_checkpointing: the recomputed blocks would draw other "
            "dropout masks than the forward did; set lora.dropout=0 or train.activation_checkpointing=false"
        )
    if lora.init_from and not lora.rank:
        raise ConfigError(
            f"lora.init_from={lora.init_from} starts adapters from a LoRA file, but lora.rank=0 trains every "
            "weight: set lora.rank (at least the file's rank)"
        )
    if lora.rank and not lora.targets:
        raise ConfigError("'lora.targets' is empty: name the Linear layers that get adapters")
    if lora.rank and not cfg.model.pretrained:
        raise ConfigError(
            f"lora.rank={lora.rank} trains adapters on a base model, but model.pretrained is not set: name "
            "a diffusers Wan folder or a tessera run (or set lora.rank=0 for full fine-tuning)"
        )


def parse_aspect_ratio(text: str) -> float:
    """'16:9' -> 16/9 (width over height)."""
    try:
        w, h = (float(x) for x in str(text).split(":"))
        if w <= 0 or h <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"data.aspect_ratios: '{text}' is not width:height with positive numbers, e.g. '16:9'"
        ) from None
    return w / h


def save_config(cfg: DictConfig, path: str | os.PathLike) -> None:
    OmegaConf.save(cfg, path, resolve=True)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


_OVERRIDE = __import__("re").compile(r"^[A-Za-z_]\w*(\.\w+)*=")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate dot-list overrides (`section.key=value`) from the other command-line arguments, so they
    can follow options that take several values (`--prompt "a" "b" parallel.dp=2`)."""
    overrides = [a for a in argv if _OVERRIDE.match(a)]
    return [a for a in argv if not _OVERRIDE.match(a)], overrides


def first_block_under_pipefusion(stages: int) -> str:
    return (
        f"sample.cache=first_block cannot run under PipeFusion (parallel.pipefusion={stages}): its stages "
        "see one patch at a time, and the first block's signal needs the whole step before the other "
        "stages start; use sample.cache=calibrated, which skips whole steps on every stage"
    )
