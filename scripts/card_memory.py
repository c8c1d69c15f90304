"""The card recipes (configs/cards/*.yaml) on the cards their names say: each recipe's modelled peak per GPU,
and whether train.py's start-up memory check accepts it there (parallel/lifecycle/memory_plan.py
plan_memory, on a simulated card and host). The models are the releases' (scripts/family_memory.py's
configs), built on the meta device from stand-in folders that hold each part's config and tensor shapes,
no weights.

    python scripts/card_memory.py [--check] [--json out.json]  (--tiny: two recipes, seconds)

--check: each recipe's header states the peaks this script counts ("modelled peak X GiB per GPU and Y GiB
of host memory"), and the peak leaves room for what the model leaves out (MARGIN, UNMODELLED): the one
measurement of the model so far (Wan2.1-14B LoRA on a float8 base, one H200, BENCHMARKS.md) ran 1.38x,
7.3 GiB, above it. A card's memory is what the GPU reports in total, less CUDA_CONTEXT for the CUDA context.
"""

import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CARDS_DIR = ROOT / "configs" / "cards"
MiB, GiB = 2**20, 2**30
CUDA_CONTEXT = GiB  # torch's CUDA context, cuBLAS's and cuDNN's workspaces: about 0.5-0.9 GiB on Hopper
# name -> (MiB the card reports in all, GPUs, host memory): an RTX 4090, an RTX 6000 Ada, 8 H100 SXM
CARDS = {
    "24gb": (24_564, 1, 64 * GiB),
    "48gb": (49_140, 1, 128 * GiB),
    "8x80gb": (81_559, 8, 1024 * GiB),
}
# the release stand-ins: family_memory.release_parts' entry, its pipeline class, its parts' subfolders
RELEASES = {
    "dit": (None, "WanPipeline", ("text_encoder", "vae")),  # Wan2.1's: wan_parts
    "qwen_image": ("Qwen-Image", "QwenImagePipeline", ("transformer", "text_encoder", "vae")),
    "qwen_image_edit": ("Qwen-Image", "QwenImageEditPlusPipeline", ("transformer", "text_encoder", "vae")),
    "sana": ("Sana 1600M", "SanaPipeline", ("transformer", "text_encoder", "vae")),
    "hunyuan_video15": (
        "HunyuanVideo 1.5", "HunyuanVideo15Pipeline", ("transformer", "text_encoder", "text_encoder_2", "vae")
    ),
    "ltx2": (
        "LTX-2", "LTX2Pipeline", ("transformer", "text_encoder", "connectors", "audio_vae", "vocoder", "vae")
    ),
    "z_image": ("Z-Image", "ZImagePipeline", ("transformer", "text_encoder", "vae")),
    "flux2": ("FLUX.2 klein 4B", "Flux2KleinPipeline", ("transformer", "text_encoder", "vae")),
    "flux2_dev": ("FLUX.2 dev", "Flux2Pipeline", ("transformer", "text_encoder", "vae")),
}  # fmt: skip
# Wan-AI/Wan2.1-T2V-14B-Diffusers' text_encoder/config.json (UMT5-XXL's encoder)
UMT5_XXL = dict(
    vocab_size=256384, d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
    feed_forward_proj="gated-gelu", is_encoder_decoder=False,
)  # fmt: skip
MARGIN, UNMODELLED = 1.4, 7 * GiB  # a recipe's modelled peak times MARGIN, and plus UNMODELLED, must fit
HEADER = re.compile(r"[Mm]odelled peak ([0-9.]+) GiB per GPU and ([0-9]+) GiB of host memory")


def card_of(recipe: Path) -> str:
    card = next((c for c in CARDS if recipe.stem.endswith(f"-{c}")), None)
    if card is None:
        raise SystemExit(f"error: {recipe}: a card recipe's name ends in -{', -'.join(CARDS)}")
    return card


def wan_parts() -> dict:
    """Wan2.1's UMT5 encoder and VAE on the meta device (its transformer is built from model.size)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        return {"UMT5-XXL": UMT5EncoderModel(UMT5Config(**UMT5_XXL)), "AutoencoderKLWan": AutoencoderKLWan()}


def release_parts(family: str, parts_of) -> tuple[str, dict]:
    """(pipeline class, {subfolder: module on the meta device}) of the family's release."""
    entry, pipeline, folders = RELEASES[family]
    built = wan_parts() if entry is None else parts_of(entry)
    return pipeline, dict(zip(folders, built.values()))


def write_stand_in(folder: Path, pipeline: str, parts: dict) -> None:
    """A pipeline folder of the release: model_index.json, the transformer's config.json, and for every
    part a .safetensors file whose header lists its tensors (no data: the memory check reads headers)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    for sub, module in parts.items():
        (folder / sub).mkdir(exist_ok=True)
        config = module.config  # diffusers' (a dict) or transformers' (to_dict)
        named = {"_class_name": type(module).__name__}
        config = config.to_dict() if hasattr(config, "to_dict") else {**named, **config}
        (folder / sub / "config.json").write_text(json.dumps(config, default=list))
        if sub == "transformer":
            continue
        header, offset = {}, 0
        for name, p in module.state_dict().items():
            end = offset + 2 * p.numel()
            header[name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, end]}
            offset = end
        data = json.dumps(header).encode()
        (folder / sub / "model.safetensors").write_bytes(len(data).to_bytes(8, "little") + data)


def recipe_on_card(recipe: Path, stand_in: Path):
    """The recipe as train.py loads it, its folders the stand-in."""
    from omegaconf import OmegaConf

    from configs import load_config

    raw = load_config(recipe)
    keys = ("model.pretrained", "vae.pretrained", "text_encoder.pretrained", "image_encoder.pretrained")
    overrides = [f"{k}={stand_in}" for k in keys if OmegaConf.select(raw, k)]
    return load_config(recipe, overrides)


def peak_on_card(cfg, card: str) -> dict:
    """The modelled peak of `cfg` on `card`, and the start-up check's verdict there."""
    from data.loader import build_buckets
    from models.families import family_named
    from parallel.compute.layout import ParallelLayout
    from parallel.drive.family_training import training_layouts
    from parallel.lifecycle import memory_plan as plan

    total_mib, gpus, host = CARDS[card]
    family = family_named(cfg.model.family)
    buckets = build_buckets(cfg)
    heads = family.heads(cfg) or cfg.parallel.ulysses
    takes = training_layouts(cfg, family, buckets)
    layout = ParallelLayout.from_config(cfg.parallel, gpus, heads, "train", gpus, takes=takes)
    setting = plan.training_setting(cfg, layout, buckets, gpus, gpus, on_gpu=True)
    model = plan.meta_model(cfg, cfg.lora.rank, on_gpu=True)
    free = total_mib * MiB - CUDA_CONTEXT
    room = plan.Room(free, host, host, f"the {card} card's host", 0)
    peak = plan.modelled_peak(model, setting)
    try:
        plan.plan_memory(cfg, setting, model, room)
        refused = ""
    except plan.MemoryPlanError as e:
        refused = str(e)
    return dict(card=card, gpus=gpus, total_gib=total_mib * MiB / GiB, free_gib=free / GiB,
                peak_gib=peak.device / GiB, host_gib=peak.host / GiB, parts=peak.describe(),
                refused=refused)  # fmt: skip


def stated_peaks(recipe: Path) -> tuple:
    """(GiB per GPU, GiB of host memory) its header states, or (None, None)."""
    comments = [line.lstrip("#").strip() for line in recipe.read_text().splitlines() if line.startswith("#")]
    found = HEADER.search(" ".join(comments))
    return (float(found.group(1)), float(found.group(2))) if found else (None, None)


def leaves_room(result: dict) -> bool:
    free, peak = result["free_gib"] * GiB, result["peak_gib"] * GiB
    return peak * MARGIN <= free and peak + UNMODELLED <= free


def main(argv=None) -> None:
    p = benchlib.parser(__doc__)
    p.add_argument("--check", action="store_true", help="each header states the counted peak")
    args = benchlib.parse_args(p, argv)
    from family_memory import release_parts as releases

    recipes = sorted(CARDS_DIR.glob("*.yaml"))
    if args.tiny:  # two of the smallest releases, one per card kind
        recipes = [r for r in recipes if r.stem in ("sana-lora-24gb", "flux2-klein-full-8x80gb")]
    cache = {}

    def parts_of(entry):  # each release built once, when a recipe needs it (seconds each)
        if entry not in cache:
            cache.update(releases({entry}))
        return cache[entry]

    rows, results, wrong = [], {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in recipes:
            family = family_asked(recipe)
            stand_in = Path(tmp) / family
            if not stand_in.exists():
                write_stand_in(stand_in, *release_parts(family, parts_of))
            try:
                result = peak_on_card(recipe_on_card(recipe, stand_in), card_of(recipe))
            except (ValueError, OSError) as e:  # a recipe that does not load or build: named
                raise SystemExit(f"error: {recipe}: {e}") from None
            results[recipe.name] = result
            counted, stated = (round(result["peak_gib"], 1), round(result["host_gib"])), stated_peaks(recipe)
            if args.check and stated != counted:
                wrong.append(f"{recipe.name}: its header says {stated} GiB, counted {counted}")
            if args.check and not leaves_room(result):
                short = f"{result['peak_gib']:.1f} GiB leaves no room for what the model leaves out"
                wrong.append(f"{recipe.name}: {short}")
            card = f"{result['gpus']} x {result['total_gib']:.1f} GiB"
            verdict = "accepted" if not result["refused"] else "REFUSED"
            rows.append([recipe.name, card, f"{result['peak_gib']:.1f} GiB", f"{result['host_gib']:.1f} GiB",
                         verdict, result["parts"]])  # fmt: skip
    heads = ["recipe", "card", "modelled peak per GPU", "host", "start-up check", "what makes it up"]
    print(benchlib.table(heads, rows))
    if args.json:
        benchlib.write_json(args.json, dict(tiny=args.tiny, recipes=results))
    refused = [f"{name}: {r['refused']}" for name, r in results.items() if r["refused"]]
    if refused or wrong:
        raise SystemExit("\n".join(["error: " + line for line in refused + wrong]))


def family_asked(recipe: Path) -> str:
    """model.family of a recipe (its bases' too), read without the folders it names (auto: the DiT's)."""
    from omegaconf import OmegaConf

    from configs import _recipe_layers

    merged = OmegaConf.merge(*(layer for _, layer in _recipe_layers(recipe, [])))
    family = OmegaConf.select(merged, "model.family", default="auto")
    return "dit" if family == "auto" else family


if __name__ == "__main__":
    main()
