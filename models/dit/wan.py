"""Wan 2.1/2.2 weights in tessera's DiT: the architecture from a diffusers `WanTransformer3DModel`
config, and its state dict under tessera's names (q, k and v concatenated into one projection; the
whole key map is in docs/internals.md). Single-device code.
"""

import json
import math
import re
from pathlib import Path

import torch

from models.dit.transformer import ARCHITECTURE_OPTIONS, DIMENSIONS, WAN_OPTIONS, DiT_models
from models.weight_files import LazyWeights, check_safetensors, check_weight_names

_RENAMES = [  # (diffusers pattern, tessera name); \\1 is the block index
    (r"patch_embedding\.(weight|bias)", r"x_embedder.proj.\1"),
    (r"condition_embedder\.time_embedder\.linear_1\.(weight|bias)", r"t_embedder.mlp.0.\1"),
    (r"condition_embedder\.time_embedder\.linear_2\.(weight|bias)", r"t_embedder.mlp.2.\1"),
    (r"condition_embedder\.time_proj\.(weight|bias)", r"time_proj.1.\1"),
    (r"condition_embedder\.text_embedder\.linear_1\.(weight|bias)", r"y_embedder.0.\1"),
    (r"condition_embedder\.text_embedder\.linear_2\.(weight|bias)", r"y_embedder.2.\1"),
    (r"scale_shift_table", r"final_layer.scale_shift_table"),
    (r"proj_out\.(weight|bias)", r"final_layer.linear.\1"),
    (r"blocks\.(\d+)\.scale_shift_table", r"blocks.\1.scale_shift_table"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"blocks\.(\d+)\.attn1\.norm_q\.weight", r"blocks.\1.attn.q_norm.weight"),
    (r"blocks\.(\d+)\.attn1\.norm_k\.weight", r"blocks.\1.attn.k_norm.weight"),
    (r"blocks\.(\d+)\.attn2\.to_q\.(weight|bias)", r"blocks.\1.cross_attn.q.\2"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.(weight|bias)", r"blocks.\1.cross_attn.proj.\2"),
    (r"blocks\.(\d+)\.attn2\.norm_q\.weight", r"blocks.\1.cross_attn.q_norm.weight"),
    (r"blocks\.(\d+)\.attn2\.norm_k\.weight", r"blocks.\1.cross_attn.k_norm.weight"),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.(weight|bias)", r"blocks.\1.mlp.0.\2"),
    (r"blocks\.(\d+)\.ffn\.net\.2\.(weight|bias)", r"blocks.\1.mlp.2.\2"),
    # image-to-video (Wan2.1 I2V / FLF2V)
    (r"condition_embedder\.image_embedder\.norm1\.(weight|bias)", r"image_embedder.norm1.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj\.(weight|bias)", r"image_embedder.ff.0.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2\.(weight|bias)", r"image_embedder.ff.2.\1"),
    (r"condition_embedder\.image_embedder\.norm2\.(weight|bias)", r"image_embedder.norm2.\1"),
    (r"condition_embedder\.image_embedder\.pos_embed", r"image_embedder.pos_embed"),
    (r"blocks\.(\d+)\.attn2\.norm_added_k\.weight", r"blocks.\1.cross_attn.image_k_norm.weight"),
]
_CONCATENATED = [  # (diffusers name template, the projections in order, tessera name template)
    ("blocks.{i}.attn1.to_{p}.{kind}", ("q", "k", "v"), "blocks.{i}.attn.qkv.{kind}"),
    ("blocks.{i}.attn2.to_{p}.{kind}", ("k", "v"), "blocks.{i}.cross_attn.kv.{kind}"),
    ("blocks.{i}.attn2.add_{p}_proj.{kind}", ("k", "v"), "blocks.{i}.cross_attn.image_kv.{kind}"),
]


# The original Wan checkpoint layout (Wan-AI's own code) -> diffusers names, as diffusers' converter
# (scripts/convert_wan_to_diffusers.py) renames them; original checkpoints may prefix every key with
# "model.diffusion_model.". The original calls the cross-attention's affine norm norm3 (its norm2, the
# MLP's, has no weights).
_ORIGINAL_RENAMES = [
    (r"time_embedding\.0\.", "condition_embedder.time_embedder.linear_1."),
    (r"time_embedding\.2\.", "condition_embedder.time_embedder.linear_2."),
    (r"text_embedding\.0\.", "condition_embedder.text_embedder.linear_1."),
    (r"text_embedding\.2\.", "condition_embedder.text_embedder.linear_2."),
    (r"time_projection\.1\.", "condition_embedder.time_proj."),
    (r"^img_emb\.proj\.0\.", "condition_embedder.image_embedder.norm1."),
    (r"^img_emb\.proj\.1\.", "condition_embedder.image_embedder.ff.net.0.proj."),
    (r"^img_emb\.proj\.3\.", "condition_embedder.image_embedder.ff.net.2."),
    (r"^img_emb\.proj\.4\.", "condition_embedder.image_embedder.norm2."),
    (r"^img_emb\.emb_pos$", "condition_embedder.image_embedder.pos_embed"),
    (r"\.cross_attn\.k_img\.", ".attn2.add_k_proj."),
    (r"\.cross_attn\.v_img\.", ".attn2.add_v_proj."),
    (r"\.cross_attn\.norm_k_img\.", ".attn2.norm_added_k."),
    (r"^head\.modulation$", "scale_shift_table"),
    (r"^head\.head\.", "proj_out."),
    (r"\.modulation$", ".scale_shift_table"),
    (r"\.ffn\.0\.", ".ffn.net.0.proj."),
    (r"\.ffn\.2\.", ".ffn.net.2."),
    (r"\.norm3\.", ".norm2."),
    (r"\.self_attn\.o\.", ".attn1.to_out.0."),
    (r"\.self_attn\.([qkv])\.", r".attn1.to_\1."),
    (r"\.self_attn\.", ".attn1."),
    (r"\.cross_attn\.o\.", ".attn2.to_out.0."),
    (r"\.cross_attn\.([qkv])\.", r".attn2.to_\1."),
    (r"\.cross_attn\.", ".attn2."),
]


def diffusers_name_from_original(key: str) -> str:
    key = key.removeprefix("model.diffusion_model.")
    for pattern, target in _ORIGINAL_RENAMES:
        key = re.sub(pattern, target, key)
    return key


def diffusers_config_from_original(config: dict) -> dict:
    """A WanTransformer3DModel config from the original layout's config.json (dim, num_heads, ...)."""
    model_type = config.get("model_type", "t2v")
    if model_type not in ("t2v", "i2v", "flf2v", "ti2v"):  # ti2v: Wan2.2-5B, as many channels out as in
        raise WanFormatError(f"Wan model_type={model_type!r} is not supported (t2v, i2v, flf2v and ti2v are)")
    return dict(  # image_dim etc.: WanWeights reads them off the weights (img_emb), as the text width
        patch_size=config.get("patch_size", [1, 2, 2]),
        num_attention_heads=config["num_heads"],
        attention_head_dim=config["dim"] // config["num_heads"],
        in_channels=config["in_dim"],
        out_channels=config.get("out_dim", 16 if model_type in ("i2v", "flf2v") else config["in_dim"]),
        text_dim=config.get("text_dim", 4096),
        freq_dim=config.get("freq_dim", 256),
        ffn_dim=config["ffn_dim"],
        num_layers=config["num_layers"],
        eps=config.get("eps", 1e-6),
        qk_norm="rms_norm_across_heads",
        cross_attn_norm=True,
    )


# every Wan release's attention head width (1.3B: 1536 / 12; 5B: 3072 / 24; 14B: 5120 / 40)
WAN_HEAD_DIM = 128


def diffusers_config_from_shapes(shapes: dict, file, heads: int | None = None) -> dict:
    """A WanTransformer3DModel config from a single file's tensor shapes ({diffusers name: shape}). No shape
    says the heads: `heads` (the recipe's model.num_heads), else the width at Wan's head width."""

    def shape(name):
        if name not in shapes:
            raise WanFormatError(f"model.pretrained={file} is not a Wan transformer file: it has no {name}")
        return shapes[name]

    if len(shape("patch_embedding.weight")) != 5:  # (width, channels, and a patch's frames, height, width)
        raise WanFormatError(f"model.pretrained={file}: its patch_embedding is not a Wan transformer's")
    dim, in_channels, *patch = shape("patch_embedding.weight")
    # the recipe's heads where they divide the width (else its model.size is another model's: named later)
    heads = heads if heads and dim % heads == 0 else None
    if heads is None and dim % WAN_HEAD_DIM:
        raise WanFormatError(
            f"model.pretrained={file}: its width {dim} is not Wan's heads of {WAN_HEAD_DIM}, and a single "
            "file does not say its heads: set model.num_heads"
        )
    heads = heads or dim // WAN_HEAD_DIM
    config = dict(
        patch_size=patch,
        num_attention_heads=heads,
        attention_head_dim=dim // heads,
        in_channels=in_channels,
        out_channels=shape("proj_out.weight")[0] // math.prod(patch),
        text_dim=shape("condition_embedder.text_embedder.linear_1.weight")[1],
        freq_dim=shape("condition_embedder.time_embedder.linear_1.weight")[1],
        ffn_dim=shape("blocks.0.ffn.net.0.proj.weight")[0],
        num_layers=1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("blocks.")),
        cross_attn_norm="blocks.0.norm2.weight" in shapes,
        qk_norm="rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in shapes else None,
    )
    image = "condition_embedder.image_embedder."
    if image + "norm1.weight" in shapes:  # CLIP features (Wan2.1 I2V / FLF2V)
        config.update(image_dim=shapes[image + "norm1.weight"][0], added_kv_proj_dim=dim)
        if image + "pos_embed" in shapes:
            config["pos_embed_seq_len"] = shapes[image + "pos_embed"][1]
    return config


class WanFormatError(ValueError):
    """A folder or state dict that is not a Wan transformer tessera can load."""


def dit_kwargs_from_diffusers_config(config: dict) -> dict:
    """DiT(...) keyword arguments for a diffusers WanTransformer3DModel config (its config.json)."""
    unsupported = {
        "qk_norm": "rms_norm_across_heads",
        "cross_attn_norm": True,
        "eps": 1e-6,
        "freq_dim": 256,
    }
    for key, expected in unsupported.items():
        if config.get(key, expected) != expected:
            raise WanFormatError(
                f"Wan config {key}={config[key]!r} is not supported (tessera expects {expected!r})"
            )
    out_channels = config.get("out_channels") or config["in_channels"]
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    image_dim, added_kv = config.get("image_dim"), config.get("added_kv_proj_dim")
    if image_dim and added_kv != heads * head_dim:  # the image embedder's output feeds add_k_proj/add_v_proj
        raise WanFormatError(
            f"Wan config image_dim={image_dim} with added_kv_proj_dim={added_kv}: tessera expects "
            f"added_kv_proj_dim = the width {heads * head_dim}"
        )
    image = dict(
        image_dim=image_dim or None, image_positions=bool(image_dim and config.get("pos_embed_seq_len"))
    )
    if image_dim and config.get("pos_embed_seq_len"):  # FLF2V: both images' tokens (else the encoder's count)
        image["image_tokens"] = config["pos_embed_seq_len"]
    return dict(
        **image,
        in_channels=config["in_channels"],
        out_channels=out_channels,  # fewer than in_channels for image-to-video (36 in, 16 out)
        text_dim=config["text_dim"],
        depth=config["num_layers"],
        hidden_size=heads * head_dim,
        num_heads=heads,
        patch_size=tuple(config["patch_size"]),
        ffn_dim=config["ffn_dim"],
        qk_norm=True,
        rope_theta=10000.0,
        **WAN_OPTIONS,
    )


def diffusers_config_from_dit(architecture: dict) -> dict:
    """The WanTransformer3DModel config of a DiT built with Wan's options (DiT.architecture()); a DiT
    without them is an error naming the options to set."""
    wrong = [
        f"model.{k}={str(v).lower() if isinstance(v, bool) else v}"
        for k, v in WAN_OPTIONS.items()
        if architecture[k] != v
    ]
    if wrong:
        raise WanFormatError(
            "only a DiT with Wan's architecture options exports to a WanTransformer3DModel; this "
            "one was trained without " + " ".join(wrong)
        )
    heads = architecture["num_heads"]
    return dict(
        patch_size=list(architecture["patch_size"]),
        num_attention_heads=heads,
        attention_head_dim=architecture["hidden_size"] // heads,
        in_channels=architecture["in_channels"],
        out_channels=architecture.get("out_channels") or architecture["in_channels"],
        text_dim=architecture["text_dim"],
        freq_dim=256,
        ffn_dim=architecture["ffn_dim"],
        num_layers=architecture["depth"],
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=architecture.get("image_dim"),
        added_kv_proj_dim=architecture["hidden_size"] if architecture.get("image_dim") else None,
        pos_embed_seq_len=architecture["image_tokens"] if architecture.get("image_positions") else None,
    )


def tessera_sources(diffusers_keys) -> dict:
    """{tessera name: [diffusers keys, concatenated along dim 0 in this order]} for a diffusers
    WanTransformer3DModel's keys. Unknown keys are an error naming them."""
    keys = set(diffusers_keys)
    sources, used = {}, set()
    for template, projections, target in _CONCATENATED:
        first = re.compile(
            re.escape(template)
            .replace(r"\{i\}", r"(\d+)")
            .replace(r"\{kind\}", "(weight|bias)")
            .replace(r"\{p\}", re.escape(projections[0]))
        )
        for key in sorted(keys):
            match = first.fullmatch(key)
            if not match:
                continue
            i, kind = match.groups()
            parts = [template.format(i=i, p=p, kind=kind) for p in projections]
            missing = [part for part in parts if part not in keys]
            if missing:
                raise WanFormatError(f"Wan state dict has {key} but not {', '.join(missing)}")
            sources[target.format(i=i, kind=kind)] = parts
            used.update(parts)
    for key in sorted(keys - used):
        for pattern, target in _RENAMES:
            if re.fullmatch(pattern, key):
                sources[re.sub("^" + pattern + "$", target, key)] = [key]
                break
        else:
            raise WanFormatError(
                f"Wan state dict key '{key}' has no tessera counterpart: tessera reads the "
                "diffusers layout of Wan's transformer (text- and image-to-video)"
            )
    return sources


def tessera_state_dict_from_diffusers(state_dict: dict) -> dict:
    """diffusers WanTransformer3DModel state dict -> tessera DiT state dict (tensors are not copied,
    except where two or three projections are concatenated into one)."""
    return {
        name: state_dict[keys[0]] if len(keys) == 1 else torch.cat([state_dict[k] for k in keys], dim=0)
        for name, keys in tessera_sources(state_dict).items()
    }


def diffusers_state_dict_from_tessera(state_dict: dict, diffusers_keys) -> dict:
    """tessera DiT state dict -> the state dict of a WanTransformer3DModel whose keys are
    `diffusers_keys` (concatenated projections are split back into equal parts)."""
    out = {}
    for name, keys in tessera_sources(diffusers_keys).items():
        if name not in state_dict:
            raise WanFormatError(f"the tessera weights have no '{name}' (needed for {', '.join(keys)})")
        for key, part in zip(keys, state_dict[name].chunk(len(keys), dim=0)):
            out[key] = part.contiguous()
    return out


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise WanFormatError(f"model.pretrained: {path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise WanFormatError(f"model.pretrained: {path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WanFormatError(
            f"model.pretrained: {path} holds a JSON {type(config).__name__}, not an object of settings"
        )
    return config


class WanWeights(LazyWeights):
    """A diffusers WanTransformer3DModel folder (config.json and one or more .safetensors files), read
    lazily: `read(name, start, stop)` returns rows start:stop (along dim 0) of one tessera parameter and
    reads only those bytes, so a rank of a sharded model reads only its own shard."""

    def __init__(self, folder, heads: int | None = None):
        self.folder = Path(folder)
        if self.folder.suffix == ".safetensors" and not self.folder.is_dir():  # `heads`: its, if known
            self._open_file(heads)
            return
        if (
            not (self.folder / "config.json").is_file()
            and (self.folder / "transformer" / "config.json").is_file()
        ):
            self.folder = self.folder / "transformer"  # a whole WanPipeline folder
        config = self.folder / "config.json"
        if not config.is_file():
            raise WanFormatError(
                f"model.pretrained={folder}: no config.json there (expected a diffusers "
                "WanTransformer3DModel folder, a WanPipeline folder with transformer/ in it, or one "
                ".safetensors file)"
            )
        self.config = _read_config(config)
        self.original = "num_heads" in self.config and "num_attention_heads" not in self.config
        try:
            if self.original:  # Wan-AI's own layout (config.json with dim, num_heads, ...)
                self.config = diffusers_config_from_original(self.config)
            if self.config.get("_class_name", "WanTransformer3DModel") != "WanTransformer3DModel":
                raise WanFormatError(
                    f"model.pretrained={folder}: config.json describes a {self.config['_class_name']}, "
                    "not a WanTransformer3DModel"
                )
            self.dit_kwargs = dit_kwargs_from_diffusers_config(self.config)
        except KeyError as e:
            raise WanFormatError(
                f"model.pretrained: {config} has no '{e.args[0]}'; a WanTransformer3DModel config.json "
                "lists in_channels, num_attention_heads, attention_head_dim, text_dim, ffn_dim, num_layers, "
                "patch_size (or, in Wan-AI's layout, dim, num_heads, in_dim, ffn_dim and num_layers)"
            ) from None
        self.files = sorted(self.folder.glob("*.safetensors"))
        if not self.files:
            raise WanFormatError(f"model.pretrained={folder}: no .safetensors files there")
        self._index(self._handles(self.files))
        self.sources = tessera_sources(self._key_file)
        if self.original:  # its config.json does not say the text width (4096 for UMT5-XXL): the weights do
            self.config["text_dim"] = self.shape("y_embedder.0.weight")[1]
            # nor whether an i2v model reads CLIP features (Wan2.1 I2V/FLF2V: img_emb; Wan2.2 I2V: none)
            for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
                self.config.pop(key, None)
            if "image_embedder.norm1.weight" in self.sources:
                self.config["image_dim"] = self.shape("image_embedder.norm1.weight")[0]
                self.config["added_kv_proj_dim"] = (
                    self.config["num_attention_heads"] * self.config["attention_head_dim"]
                )
                if "image_embedder.pos_embed" in self.sources:
                    self.config["pos_embed_seq_len"] = self.shape("image_embedder.pos_embed")[1]
            self.dit_kwargs = dit_kwargs_from_diffusers_config(self.config)

    def _open_file(self, heads):
        """One .safetensors file (ComfyUI's and Wan-AI's single files, in the original names, or a file in
        diffusers' names): no config.json, so the architecture comes from the tensors' shapes."""
        self.files = [self.folder]
        if not self.folder.is_file():
            raise WanFormatError(f"model.pretrained={self.folder}: no such file")
        handles = self._handles(self.files)
        keys = handles[0].keys()
        if any(k == "scaled_fp8" or k.endswith(".scale_weight") for k in keys):  # ComfyUI's fp8_scaled files
            raise WanFormatError(
                f"model.pretrained={self.folder} is ComfyUI's scaled float8 file, whose weights need their "
                "scales: use the release's fp16 or bf16 file"
            )
        # diffusers' names have a condition_embedder; the original's time_embedding, text_embedding, ...
        self.original = not any(k.removeprefix("model.diffusion_model.").startswith("condition_embedder.")
                                for k in keys)  # fmt: skip
        self._index(handles)
        shapes = {n: tuple(h.get_slice(self._file_key[n]).get_shape()) for n, h in self._key_file.items()}
        self.config = diffusers_config_from_shapes(shapes, self.folder, heads)  # before the names: not Wan's
        self.sources = tessera_sources(self._key_file)
        self.dit_kwargs = dit_kwargs_from_diffusers_config(self.config)

    @staticmethod
    def _handles(files) -> list:
        """Each file checked (its header: a truncated file named) and opened."""
        from safetensors import safe_open

        handles = []
        for file in files:
            check_safetensors(file, error=WanFormatError)
            try:
                handles.append(safe_open(str(file), framework="pt"))
            except Exception as e:  # noqa: BLE001 - safetensors' own error type
                raise WanFormatError(
                    f"model.pretrained: {file} cannot be read as safetensors ({e})"
                ) from None
        return handles

    def _index(self, handles):
        """Every tensor of the files by its diffusers name: the file's handle, its key in the file."""
        self._key_file, self._file_key = {}, {}
        for handle in handles:
            for key in handle.keys():
                name = diffusers_name_from_original(key) if self.original else key
                self._key_file[name] = handle
                self._file_key[name] = key

    def check_parameters(self, names, partial: bool = False) -> None:
        """Every weight of the folder has a place among the model's parameter `names` (state-dict names)
        and every parameter has a weight; `partial` (a PipeFusion stage): every parameter has a weight."""
        check_weight_names(self.folder, names, self.sources, partial, WanFormatError)

    def shape(self, name: str) -> tuple:
        keys = self.sources[name]
        shapes = [tuple(self._key_file[k].get_slice(self._file_key[k]).get_shape()) for k in keys]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of tessera parameter `name` (float32)."""
        if name not in self.sources:
            raise WanFormatError(f"model.pretrained={self.folder} has no weights for '{name}'")
        pieces, offset = [], 0
        for key in self.sources[name]:
            part = self._key_file[key].get_slice(self._file_key[key])
            rows = part.get_shape()[0]
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                pieces.append(part[lo - offset : hi - offset].float())
            offset += rows
        if not pieces:  # an empty shard
            return torch.empty((0, *self.shape(name)[1:]), dtype=torch.float32)
        return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]

    def where(self, name: str) -> str:
        """The safetensors file and key of the first of `name`'s tensors that holds NaN or inf (read again:
        only on the way to an error), else of its first."""
        from safetensors import safe_open

        keys = self.sources[name]
        read = lambda k: self._key_file[k].get_tensor(self._file_key[k])  # noqa: E731
        key = self._file_key[next((k for k in keys if not torch.isfinite(read(k)).all()), keys[0])]
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                if key in f.keys():
                    return f"model.pretrained={self.folder}: tensor '{key}' in {file}"
        return f"model.pretrained={self.folder}: tensor '{key}'"


def check_wan_folder(folder) -> None:
    """Read a Wan folder's config.json and every safetensors header (a few KB a file), so that a missing,
    truncated or unreadable file is a WanFormatError naming it before any process group exists."""
    WanWeights(folder)


def second_expert(pretrained, pretrained_2=None) -> tuple[str | None, float | None]:
    """(the low-noise expert's folder, the pipeline's boundary_ratio) of a Wan 2.2 A14B model:
    model.pretrained_2, else model.pretrained's transformer_2/ when it is a pipeline folder with one."""
    pretrained_2 = pretrained_2 or None  # "" in a recipe means unset
    boundary, index = None, Path(pretrained or "") / "model_index.json"
    if pretrained and index.is_file():
        boundary = _read_config(index).get("boundary_ratio")
        folder = Path(pretrained) / "transformer_2"
        if pretrained_2 is None and (folder / "config.json").is_file():
            pretrained_2 = str(folder)
    return pretrained_2, boundary


def resolve_auto_size(cfg, error=ValueError) -> None:
    """Fill cfg.model from the Wan folder (or single file) in model.pretrained: model.size (the named size
    with its depth, width and heads), the options, patch_size and task. `error`: the exception type to
    raise."""
    mc = cfg.model
    folder = mc.pretrained
    single = bool(folder) and Path(folder).is_file() and folder.endswith(".safetensors")
    if not folder or not (Path(folder).is_dir() or single):
        raise error(
            "model.size=auto reads the architecture from model.pretrained's folder or .safetensors file: "
            f"got {folder!r}"
        )
    configured = (Path(folder) / "config.json").is_file() or (Path(folder) / "transformer").is_dir()
    if not single and not configured:
        raise error(
            f"model.size=auto reads a Wan folder's config.json; {folder} has none (a tessera run keeps "
            "its own recipe: name its model.size)"
        )
    try:
        found = WanWeights(folder, mc.num_heads).dit_kwargs
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
