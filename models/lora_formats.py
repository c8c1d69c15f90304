"""LoRA files in the formats people share, to and from tessera's adapters; single-device code.

- diffusers/PEFT: `transformer.blocks.0.attn1.to_q.lora_A.weight` / `lora_B.weight`, no alpha tensor (the
  scale is folded into B on export; on import, diffusers' stored PEFT config gives it);
- ComfyUI / Wan-AI's original names: `diffusion_model.blocks.0.self_attn.q.lora_A.weight` (or
  `lora_down`/`lora_up`), with an optional `.alpha` per module;
- kohya / musubi-tuner: `lora_unet_blocks_0_self_attn_q.lora_down.weight`, `lora_up`, `.alpha`;
- tessera's own names (`tessera.blocks.0.attn.qkv.lora_A.weight`), for DiTs without Wan's architecture.
tessera's fused q/k/v (and cross-attention k/v) Linear exports exactly as one adapter per projection
(its own A under lora.per_projection, else a shared A; B split by rows). An imported per-projection
adapter adds its update to its rows (infer.py --lora) or becomes that projection's adapter
(lora.init_from). Key lists and sources: FIELD_NOTES "LoRA: formats people share", docs/internals.md.
"""

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

FORMATS = ("diffusers", "comfyui")


class LoRAFormatError(ValueError):
    """A LoRA file that cannot be read, or that does not fit the model (the message names the keys)."""


# tessera module (regex; \1 the block index) -> its projections in Wan's diffusers and original names,
# in the order of their rows in the tessera weight.
_WAN_MODULES = [
    (
        r"blocks\.(\d+)\.attn\.qkv",
        ["blocks.\\1.attn1.to_q", "blocks.\\1.attn1.to_k", "blocks.\\1.attn1.to_v"],
        ["blocks.\\1.self_attn.q", "blocks.\\1.self_attn.k", "blocks.\\1.self_attn.v"],
    ),
    (r"blocks\.(\d+)\.attn\.proj", ["blocks.\\1.attn1.to_out.0"], ["blocks.\\1.self_attn.o"]),
    (r"blocks\.(\d+)\.cross_attn\.q", ["blocks.\\1.attn2.to_q"], ["blocks.\\1.cross_attn.q"]),
    (
        r"blocks\.(\d+)\.cross_attn\.kv",
        ["blocks.\\1.attn2.to_k", "blocks.\\1.attn2.to_v"],
        ["blocks.\\1.cross_attn.k", "blocks.\\1.cross_attn.v"],
    ),
    (
        r"blocks\.(\d+)\.cross_attn\.image_kv",  # image-to-video: the image's keys and values
        ["blocks.\\1.attn2.add_k_proj", "blocks.\\1.attn2.add_v_proj"],
        ["blocks.\\1.cross_attn.k_img", "blocks.\\1.cross_attn.v_img"],
    ),
    (r"blocks\.(\d+)\.cross_attn\.proj", ["blocks.\\1.attn2.to_out.0"], ["blocks.\\1.cross_attn.o"]),
    (r"blocks\.(\d+)\.mlp\.0", ["blocks.\\1.ffn.net.0.proj"], ["blocks.\\1.ffn.0"]),
    (r"blocks\.(\d+)\.mlp\.2", ["blocks.\\1.ffn.net.2"], ["blocks.\\1.ffn.2"]),
    (r"y_embedder\.0", ["condition_embedder.text_embedder.linear_1"], ["text_embedding.0"]),
    (r"y_embedder\.2", ["condition_embedder.text_embedder.linear_2"], ["text_embedding.2"]),
    (r"t_embedder\.mlp\.0", ["condition_embedder.time_embedder.linear_1"], ["time_embedding.0"]),
    (r"t_embedder\.mlp\.2", ["condition_embedder.time_embedder.linear_2"], ["time_embedding.2"]),
    (r"time_proj\.1", ["condition_embedder.time_proj"], ["time_projection.1"]),
    (r"final_layer\.linear", ["proj_out"], ["head.head"]),
    (r"image_embedder\.ff\.0", ["condition_embedder.image_embedder.ff.net.0.proj"], ["img_emb.proj.1"]),
    (r"image_embedder\.ff\.2", ["condition_embedder.image_embedder.ff.net.2"], ["img_emb.proj.3"]),
]


@dataclass
class Projection:
    """One Linear as a LoRA file names it: a tessera module, and the rows of its weight it covers."""

    module: str  # tessera module name
    rows: slice | None  # None: every row
    diffusers: str
    original: str
    # the original release's name where its code fuses, renames or reorders this Linear (files trained on
    # that code name it so: ai-toolkit's, musubi-tuner's), and the rows of the release's weight that are
    # this Linear's, of its `release_size`; None: as `original`
    release: str | None = None
    release_rows: torch.Tensor | None = None
    release_size: int = 0


def wan_projections(module: str, out_features: int) -> list[Projection] | None:
    """The projections of one tessera Linear in Wan's names, or None if it has no Wan counterpart."""
    for pattern, diffusers, original in _WAN_MODULES:
        match = re.fullmatch(pattern, module)
        if match:
            n = len(diffusers)
            part = out_features // n
            return [
                Projection(
                    module,
                    slice(i * part, (i + 1) * part) if n > 1 else None,
                    match.expand(d),
                    match.expand(o),
                )
                for i, (d, o) in enumerate(zip(diffusers, original))
            ]
    return None


def model_projections(model, names=None) -> tuple[dict, dict]:
    """({tessera module: its projections} for every Linear of `model`, {module: (in_features,
    out_features)}); Wan names when the DiT has Wan's architecture options, else each Linear is one
    projection under its tessera name; `names(module) -> diffusers name` for a family
    whose modules are diffusers' Linears one for one (models/family.py). Works on a meta-device model."""
    from torch import nn

    from models.dit.transformer import WAN_OPTIONS

    linears = {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not name.endswith((".lora_A", ".lora_B"))
    }
    if names is not None:  # the original single files keep diffusers' names (Qwen-Image, Sana's LoRAs)
        return {m: [Projection(m, None, names(m), names(m))] for m in linears}, linears
    architecture = model.architecture()
    wan = all(architecture.get(k) == v for k, v in WAN_OPTIONS.items())
    own = lambda m: [Projection(m, None, f"tessera.{m}", f"tessera.{m}")]  # noqa: E731
    return {m: (wan and wan_projections(m, out)) or own(m) for m, (_, out) in linears.items()}, linears


def with_release_names(projections: dict, linears: dict, to_original, from_original) -> dict:
    """`projections` (one per Linear, in diffusers' names) with the release's name of each Linear whose
    name or rows the original release changes, and the rows of the release's weight that are its own. The
    family's two weight renamings define them (a meta state dict of the Linears to the release's names,
    then each release weight's row numbers back), so no second table of names is kept."""
    named = {p.diffusers: p for found in projections.values() for p in found}
    meta = {f"{n}.weight": torch.empty(linears[p.module][::-1], device="meta") for n, p in named.items()}
    release = {}
    for key, weight in to_original(meta).items():
        if key in meta or not key.endswith(".weight") or weight.dim() != 2:
            continue  # a name the release keeps, rows and all (from_original may refuse a lone one)
        numbers = torch.arange(weight.shape[0], dtype=torch.float64).unsqueeze(1)
        for back, rows in from_original({key: numbers}).items():
            p, rows = named.get(back.removesuffix(".weight")), rows[:, 0].long()
            if p is not None:
                release[p.diffusers] = dict(release=key.removesuffix(".weight"), release_rows=rows,
                                            release_size=len(numbers))  # fmt: skip
    return {
        module: [replace(p, **release[p.diffusers]) if p.diffusers in release else p for p in found]
        for module, found in projections.items()
    }


def is_wan_named(projections: dict) -> bool:
    return not any(p.diffusers.startswith("tessera.") for projs in projections.values() for p in projs)


# ------------------------------------------------------------------------------------------------
# Writing


def export_adapters(
    adapters: dict, projections: dict, fmt: str, alphas: bool = True, release: bool = False
) -> dict[str, torch.Tensor]:
    """A LoRA state dict in `fmt` ("diffusers" or "comfyui") from tessera adapters {module: (A, B,
    scale)}. A fused module becomes one adapter per projection (_file_adapters). `alphas` False: ComfyUI's
    names without alphas, the scale in B (LTX-2's, as Lightricks' trainer writes them). `release`: ComfyUI's
    names are the original release's, whose fused weights take one adapter (_fused_adapters)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown LoRA format {fmt!r}; choose one of {', '.join(FORMATS)}")
    written = []  # (name, A, B, scale, (rows, size) in a release weight)
    for module, (A, B, scale) in adapters.items():
        for p, a, b in _file_adapters(A, B, projections[module]):
            name, rows = p.diffusers if fmt == "diffusers" else p.original, None
            if fmt == "comfyui" and release and p.release is not None:
                name, rows = p.release, (p.release_rows, p.release_size)
            prefix = "transformer" if fmt == "diffusers" else "diffusion_model"
            written.append((name if name.startswith("tessera.") else f"{prefix}.{name}", a, b, scale, rows))
    out = {}
    for key, a, b, scale in _fused_adapters(written):
        out[f"{key}.lora_A.weight"] = a.float().clone()  # a shared A: one copy each
        if fmt == "diffusers" or not alphas:  # no alpha: the scale goes into B
            out[f"{key}.lora_B.weight"] = (b.float() * scale).contiguous()
        else:
            out[f"{key}.lora_B.weight"] = b.float().contiguous()
            out[f"{key}.alpha"] = torch.tensor(scale * a.shape[0], dtype=torch.float32)
    return out


def _fused_adapters(written: list) -> list:
    """[(key, A, B, scale)]: the adapters of the Linears one release weight holds (its fused q, k, v) as one
    adapter of that weight, exact: their A stacked, their B block-diagonal on the weight's rows, each scale
    in its B."""
    groups = {}
    for key, *rest in written:
        groups.setdefault(key, []).append(rest)
    out = []
    for key, parts in groups.items():
        if len(parts) == 1 and parts[0][3] is None:
            out.append((key, *parts[0][:3]))
            continue
        A = torch.cat([a.float() for a, *_ in parts])
        B = A.new_zeros(parts[0][3][1], A.shape[0])
        start = 0
        for a, b, scale, (rows, _) in parts:
            B[rows, start : start + a.shape[0]] = b.float() * scale
            start += a.shape[0]
        out.append((key, A, B, 1.0))
    return out


def _file_adapters(A, B, projections: list) -> list:
    """[(projection, A, B)] of one tessera adapter as a file holds it. Per-projection adapters on a fused
    Linear (A with n times B's rank) give each projection its A rows and B rows; kept fused (tessera's own
    names), they become one block-diagonal adapter of rank n r, exact too. A shared A goes to each."""
    n = A.shape[0] // B.shape[1]
    if n == 1:
        return [(p, A, B[p.rows] if p.rows is not None else B) for p in projections]
    if len(projections) == 1:
        return [(projections[0], A, torch.block_diag(*B.chunk(n)))]
    return [(p, a, B[p.rows]) for p, a in zip(projections, A.chunk(n), strict=True)]


# ------------------------------------------------------------------------------------------------
# Reading

_SUFFIXES = {  # key ending -> the role it plays
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_A.default.weight": "A",
    ".lora_B.default.weight": "B",
    ".lora_down.weight": "A",
    ".lora_up.weight": "B",
    ".alpha": "alpha",
}


def split_key(key: str) -> tuple[str, str] | None:
    """('<module path as written>', 'A' | 'B' | 'alpha'), or None for a key of no LoRA role."""
    for suffix, role in _SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def check_file(path) -> Path:
    """A LoRA file that exists, is a .safetensors file and is as long as its header says (a few KB read)."""
    from models.weight_files import WeightFileError, check_safetensors

    path = Path(path)
    if not path.is_file():
        raise LoRAFormatError(f"LoRA file {path} does not exist")
    if path.suffix != ".safetensors":
        raise LoRAFormatError(f"LoRA file {path}: tessera reads LoRAs as .safetensors files")
    try:
        check_safetensors(path, what="LoRA file")
    except WeightFileError as e:
        raise LoRAFormatError(str(e)) from None
    return path


def read_file(path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """A LoRA's tensors from a .safetensors file and the PEFT config diffusers may store in its header
    (`lora_adapter_metadata`: r, lora_alpha, alpha_pattern), refusing a missing, truncated or damaged
    file by name."""
    from safetensors import safe_open

    path = check_file(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors' own error type
        raise LoRAFormatError(f"LoRA file {path} cannot be read as safetensors ({e})") from None
    bad = next((k for k, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()), None)
    if bad is not None:  # merged or trained on, it would make every output NaN
        raise LoRAFormatError(
            f"LoRA file {path}: tensor '{bad}' holds NaN or inf (the first such tensor); the file is damaged "
            "or was saved from a diverged run: use another one, or export it again"
        )
    raw = metadata.get("lora_adapter_metadata")
    try:
        config = json.loads(raw) if raw else None
    except ValueError:
        raise LoRAFormatError(f"LoRA file {path}: its lora_adapter_metadata is not JSON") from None
    if config:  # diffusers prefixes the keys with the component's name when it saves a pipeline's LoRA
        config = {k.removeprefix("transformer."): v for k, v in config.items()}
        if config.get("use_dora"):
            raise LoRAFormatError(f"LoRA file {path} is a DoRA (use_dora): tessera applies plain LoRAs only")
    return tensors, config


def peft_scale(config: dict | None, module: str, rank: int) -> float:
    """The scale PEFT gives an adapter whose file has no alpha tensor: lora_alpha / r from diffusers'
    stored config (alpha_pattern by module-name suffix, rsLoRA's alpha / sqrt(r)); 1 without a config,
    as diffusers loads such a file."""
    if not config:
        return 1.0
    alpha = config.get("lora_alpha", rank)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # the first match wins, as in PEFT
            alpha = value
            break
    return alpha / (rank**0.5 if config.get("use_rslora") else rank)


def _written(name: str) -> list:
    """The keys under which files write a module's name."""
    if name.startswith("tessera."):
        return [name, name.removeprefix("tessera.")]
    kohya = "lora_unet_" + name.replace(".", "_")  # kohya / musubi-tuner
    return [name, f"transformer.{name}", f"diffusion_model.{name}", f"model.diffusion_model.{name}", kohya]


def _lookup(projections: dict) -> dict[str, list]:
    """Every name under which a file may address a Linear -> [(projection, the rows of the file's B that
    are its own, None: all)]: several for a release weight that holds several Linears (fused q, k, v)."""
    table = {}
    for projs in projections.values():
        for p in projs:
            release = [(p.release, p.release_rows)] if p.release else []
            for name, rows in [(p.diffusers, None), (p.original, None), *release]:
                for key in _written(name):
                    entries = table.setdefault(key, [])
                    if not entries or rows is not None and all(q is not p for q, _ in entries):
                        entries.append((p, rows))  # kohya's underscores may make one key of two names
    return table


@dataclass
class LoRAUpdate:
    """A LoRA file matched to a model: per projection, its A, B and scale alpha / r (1 without alpha)."""

    path: str
    updates: list  # [(Projection, A, B, scale)]
    rank: int

    def deltas(self, strength: float = 1.0) -> dict:
        """{tessera module: [(rows, strength * scale * B A)]} in float32, for models.lora.merge_deltas."""
        out = {}
        for p, A, B, scale in self.updates:
            out.setdefault(p.module, []).append((p.rows, strength * scale * (B.float() @ A.float())))
        return out

    def factors(self, strength: float = 1.0) -> dict:
        """deltas', factored: {tessera module: [(rows, A, B, strength * scale)]} (merge_deltas makes each)."""
        out = {}
        for p, A, B, scale in self.updates:
            out.setdefault(p.module, []).append((p.rows, A, B, strength * scale))
        return out


def match_lora(
    tensors: dict, projections: dict, linears_in: dict, path: str = "LoRA", config: dict | None = None
) -> LoRAUpdate:
    """Match a LoRA state dict to a model's Linear layers. Any key that addresses no Linear, an adapter
    without its A or B, or a shape that does not fit is an error that counts the matched keys and names
    the others (a LoRA made for another model never becomes a silent no-op)."""
    table, groups, unknown = _lookup(projections), {}, []
    for key, tensor in tensors.items():
        parts = split_key(key)
        if parts is None or parts[0] not in table:
            unknown.append(key)
            continue
        groups.setdefault(parts[0], {})[parts[1]] = tensor
    matched = len(tensors) - len(unknown)
    if unknown or not groups:
        shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        raise LoRAFormatError(
            f"{path}: {matched} of {len(tensors)} keys match this model's layers; no layer for "
            f"{shown or 'any'}"
            " (tessera reads diffusers/PEFT, ComfyUI/original and kohya/musubi names of this model's "
            "transformer; a LoRA for another model family does not apply)"
        )
    updates, wrong, ranks, applied = [], [], set(), {}
    for name, parts in sorted(groups.items()):
        if "A" not in parts or "B" not in parts:
            wrong.append(f"{name} has no {'lora_B (lora_up)' if 'A' in parts else 'lora_A (lora_down)'}")
            continue
        A, B, entries = parts["A"], parts["B"], table[name]
        total = entries[0][0].release_size if entries[0][1] is not None else None
        if total is not None and (A.dim() != 2 or B.dim() != 2 or B.shape[0] != total):
            wrong.append(f"{name}: A {tuple(A.shape)}, B {tuple(B.shape)}; this model's has {total} rows")
            continue
        found = [(p, B if rows is None else B[rows]) for p, rows in entries]
        for p, (a, part) in _own_blocks(A, found) if total is not None else [(p, (A, b)) for p, b in found]:
            expected = linears_in[p.module][1] if p.rows is None else p.rows.stop - p.rows.start
            if (
                a.dim() != 2
                or part.dim() != 2
                or a.shape[0] != part.shape[1]
                or a.shape[1] != linears_in[p.module][0]
                or part.shape[0] != expected
            ):
                wrong.append(
                    f"{name}: A {tuple(A.shape)}, B {tuple(B.shape)}; this model's layer takes "
                    f"{linears_in[p.module][0]} -> {expected if total is None else total}"
                )
                break
            if (p.module, str(p.rows)) in applied:  # two keys, one layer: its update would count twice
                wrong.append(f"{name} and {applied[p.module, str(p.rows)]} adapt the same layer {p.module}")
                break
            applied[p.module, str(p.rows)] = name
            rank = A.shape[0]  # the file's: its alpha / rank scales the whole adapter
            bare = name.removeprefix("transformer.")
            scale = float(parts["alpha"]) / rank if "alpha" in parts else peft_scale(config, bare, rank)
            ranks.add(a.shape[0])
            updates.append((p, a, part, scale))
    if wrong:
        raise LoRAFormatError(
            f"{path} was made for another model size or architecture: {len(groups) - len(wrong)} of "
            f"{len(groups)} adapters fit; "
            + "; ".join(wrong[:4])
            + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        )
    return LoRAUpdate(str(path), updates, max(ranks))


def _own_blocks(A, found: list) -> list:
    """[(projection, (A, B))] of the Linears one release weight holds (`found`: each with its rows of the
    file's B), each cut to the columns of the rank its B uses: exact (the others add zero), so a
    block-diagonal file (trainers' and export_adapters' fused q, k, v) gives each its own rank, whatever
    their order or ranks, and lora.init_from the rank the run trained. A Linear whose rows are all zero is
    left out while another's are not (a file that adapts q and v of a fused q, k, v)."""
    used = [b.abs().sum(0) != 0 for _, b in found]
    if not any(u.any() for u in used):  # nothing trained yet: each its share of the rank when it divides
        count, rank = len(found), A.shape[0]
        if rank % count:
            return [(p, (A, b)) for p, b in found]
        used = [torch.arange(rank) // (rank // count) == i for i in range(count)]
    return [(p, (A[u], b[:, u])) for (p, b), u in zip(found, used, strict=True) if u.any()]


MAX_LORA_SCALE = 100.0  # strengths are used between about -2 and 2: beyond this, a typo (1e39, nan)


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """'FILE' or 'FILE:SCALE' -> (FILE, SCALE); a Windows drive letter is not a scale. A scale that is not a
    finite number within +-MAX_LORA_SCALE (nan, inf, 1e39, which is inf in float32) is refused here, before
    anything loads: it would make every output NaN, found only after all the sampling."""
    path, sep, scale = spec.rpartition(":")
    if sep and path:
        try:
            value = float(scale)
        except ValueError:
            return spec, 1.0
        if not math.isfinite(value) or abs(value) > MAX_LORA_SCALE:
            raise ValueError(
                f"--lora {spec}: its strength {scale} is not a number between -{MAX_LORA_SCALE:g} and "
                f"{MAX_LORA_SCALE:g} (LoRAs are used at about 0.5 to 1.5); give FILE:STRENGTH, e.g. "
                f"{path}:0.8"
            )
        return path, value
    return spec, 1.0


def safetensors_metadata(info: dict) -> dict[str, str]:
    """Strings for a safetensors header's __metadata__ (which holds str -> str only)."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}


def starting_adapters(update: LoRAUpdate, modules: dict, seed: int) -> dict[str, torch.Tensor]:
    """lora.init_from: the whole float32 adapter tensors {parameter name: tensor} of the modules that a
    LoRA file covers, so that training starts from base + that LoRA exactly. `modules`: the run's
    LoRALinear layers {name: module} (meta device will do). Each file adapter becomes its projection's
    adapter, its scale folded into B (the run's alpha / rank stays the recipe's); a lower rank than
    lora.rank is padded (A's extra rows from lora.seed, B's extra columns zero: they add nothing). What
    the file lacks keeps lora.seed's initialisation. A file adapter with no adapter in this run, a higher
    rank, or per-projection adapters for a shared A (lora.per_projection=false) is refused by name."""
    from models.lora import seeded_adapter

    out, outside, wrong = {}, [], []
    for p, a, b, scale in update.updates:
        m = modules.get(p.module)
        if m is None:
            outside.append(p.module)
            continue
        n, rank = m.lora_groups, m.lora_B.weight.shape[1]
        names = f"{p.module}.lora_A.weight", f"{p.module}.lora_B.weight"
        for name, param in zip(names, (m.lora_A.weight, m.lora_B.weight)):
            if name not in out:  # once per module, not once per projection
                out[name] = seeded_adapter(name, param.shape, seed)
        A, B = (out[name] for name in names)
        part = B.shape[0] // n
        if p.rows is not None and n == 1:
            wrong.append(
                f"{p.module} has one adapter per projection in the file, and one shared A in this run: set "
                "lora.per_projection=true"
            )
            continue
        if p.rows is not None:  # one projection of a fused Linear
            blocks = [(p.rows.start // part, a, b)]
        elif n > 1:  # a fused Linear in tessera's own names: block-diagonal, rank n r
            r = a.shape[0] // n
            diagonal = [b[i * part : (i + 1) * part, i * r : (i + 1) * r] for i in range(n)]
            if a.shape[0] % n or not torch.equal(torch.block_diag(*diagonal), b):
                wrong.append(
                    f"{p.module}: the file's adapter shares one A among the fused projections (not "
                    "block-diagonal): set lora.per_projection=false, as the run that wrote it"
                )
                continue
            blocks = list(zip(range(n), a.chunk(n), diagonal))
        else:
            blocks = [(0, a, b)]
        for i, a_i, b_i in blocks:
            if a_i.shape[0] > rank:
                fused = getattr(m, "fused_projections", 1)
                hint = (
                    f" (one adapter per projection of {fused}? set lora.per_projection=true)"
                    if fused > n
                    else ""
                )
                wrong.append(
                    f"{p.module} has rank {a_i.shape[0]} in the file, more than lora.rank={rank}{hint}"
                )
                continue
            A[i * rank : i * rank + a_i.shape[0]] = a_i.float()
            rows = slice(i * part, (i + 1) * part)  # every row when n == 1
            B[rows, : b_i.shape[1]] = b_i.float() * (scale / m.lora_scale)
    if outside:
        wrong.insert(
            0,
            f"{len(set(outside))} layers have adapters in the file and none in this run "
            f"({', '.join(sorted(set(outside))[:4])}): add them to lora.targets",
        )
    wrong = list(dict.fromkeys(wrong))  # the projections of one fused layer say it once
    if wrong:
        raise LoRAFormatError(f"{update.path}: " + "; ".join(wrong[:4]))
    return out
