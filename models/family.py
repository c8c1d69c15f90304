"""Model families (DESIGN.md, Model families): what differs between models is declared by one object
per family, in models/<family>/, and read through this interface, so that code above models/ asks the
family instead of branching on its name. A family says which folders it recognises, how it loads its
transformer, text encoder and VAE, how it encodes a prompt; its declared parts say how it loads
(models/loading.py), trains (objective.py), guides (guidance.py) and samples: noise, schedule, steps and
decoding (steps.py). models/sampler.py runs the one sampling loop over these pieces.

`dit` is tessera's own DiT, which reads Wan 2.1 / 2.2 folders (models/dit/family.py): it samples, trains
and exports through these hooks as the others do.
"""

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from models.capabilities import Capabilities
from models.guidance import Guidance
from models.loading import Loading
from models.names import Names
from models.objective import Objective
from models.steps import Steps
from models.weight_files import LazyWeights, check_safetensors, check_weight_names

# the manifest key of an edit pair's input images (Qwen-Image-Edit's training reads them: given_frames)
REFERENCES = "references"


@dataclass
class Components:
    """A family's loaded pieces, on one device, frozen."""

    transformer: torch.nn.Module
    tokenizer: object
    text_encoder: torch.nn.Module
    vae: torch.nn.Module
    scheduler_config: dict = field(default_factory=dict)  # the folder's scheduler/scheduler_config.json
    cache: object = None  # sample.cache (models/step_cache.py step_cache), or None; the DiT's is its flow's
    texts: dict = field(default_factory=dict)  # {prompt: its conditioning}: Family.encode_first


class Family:
    """The interface; each family subclasses it. Sizes: latents (B, C, T, H, W); images (B, 3, T, H, W)
    in [-1, 1]."""

    name = ""
    title = ""  # how messages name it
    pipeline_classes: tuple = ()  # model_index.json's _class_name of its diffusers pipelines
    transformer_classes: tuple = ()  # its transformer's config.json _class_name
    capabilities = Capabilities()  # what it takes, and why not where it does not (models/capabilities.py)
    vae_class = ""  # its VAE's diffusers class
    max_length = 0  # its pipeline's max_sequence_length (text_encoder.max_length)
    lora_targets: tuple = ()  # lora.targets' default: its Linear layers a LoRA adapts (fnmatch patterns)
    names = Names()  # its weights' and LoRAs' names (models/names.py): diffusers', the release's, tessera's
    conditioning = None  # the dataclass of tensors `encode` returns (its fields shared between ranks)
    loading = Loading()  # where its parts come from and the order they load in (models/loading.py)
    objective = Objective()  # how it trains: noise, loss, velocity, distillation (models/objective.py)
    guidance = Guidance()  # whether a scale guides, a step's scale, the rule (models/guidance.py)
    steps = Steps()  # noise, schedule, walk, a step's velocity, patch pieces, decoding (models/steps.py)
    # its transformer takes the guidance scale as an input (FLUX.2 dev, guidance-distilled): no CFG batch and
    # no negative prompt; its training gives it train.guidance (None: `training_guidance`)
    guidance_embedded, training_guidance = False, None

    def resolve_size(self, cfg, error=ValueError) -> None:
        """model.size: the recipe's dimensions, filled from model.pretrained's folder under model.size=auto,
        or a size the family does not take refused by name (`error`: the exception type)."""
        if cfg.model.size != "auto":
            raise error(
                f"model.family={self.name} reads its dimensions from model.pretrained's folder: set "
                f"model.size=auto (got model.size={cfg.model.size})"
            )

    def check_size_keys(self, mc, error=ValueError) -> None:
        """Refuse (`error`) the recipe's model.* size keys where they do not build a model of the family."""

    def recognises(self, folder) -> bool:
        """Whether `folder` (a pipeline folder, or a transformer folder) holds this family: a pipeline
        folder by its pipeline's class alone (Qwen-Image and Qwen-Image-Edit share a transformer class)."""
        pipeline = read_json(Path(folder) / "model_index.json").get("_class_name")
        if pipeline:
            return pipeline in self.pipeline_classes
        found = folder_classes(folder)
        return bool(found & {*self.pipeline_classes, *self.transformer_classes})

    def check_pretrained(self, cfg) -> None:
        """Each part present before anything loads (model.pretrained's transformer with its weights and
        scheduler; the VAE, text encoder and tokenizer from their keys or model.pretrained), the VAE of the
        family's class and the scheduler one it runs, or an error naming the key and the folder."""
        keys = dict(
            transformer="model.pretrained", vae="vae.pretrained", text_encoder="text_encoder.pretrained"
        )
        keys["tokenizer"] = keys["text_encoder"]
        if not cfg.model.pretrained:
            raise FileNotFoundError(f"{self.title} samples a diffusers pipeline folder: set model.pretrained")
        wanted = dict(
            transformer=("config.json", "diffusion_pytorch_model*.safetensors"),
            vae=("config.json",),
            text_encoder=("config.json",),
            tokenizer=("tokenizer*.json",),
        )
        if is_single_file(cfg.model.pretrained):  # its header read: a truncated file is named now
            check_safetensors(Path(cfg.model.pretrained))
            del wanted["transformer"]
            self.transformer_config(cfg)  # a config from the folder or the shapes, or refused by name
            self.check_file_names(cfg)
        for part in wanted:
            key, folder = keys[part], part_folder(cfg, part)
            missing = [name for name in wanted[part] if not any(folder.glob(name))]
            if missing:
                raise FileNotFoundError(
                    f"{key}: no {self.title} {part} in {folder} ({' '.join(missing)} missing; a diffusers "
                    f"pipeline folder holds {part}/; tessera never downloads)"
                )
        if not is_single_file(cfg.model.pretrained):
            for file in transformer_files(part_folder(cfg, "transformer")):
                check_safetensors(file)  # its header: a truncated file is named now
        vae = read_json(part_folder(cfg, "vae") / "config.json").get("_class_name")
        if vae != self.vae_class:
            folder = part_folder(cfg, "vae")
            raise ValueError(f"vae.pretrained: {folder} holds a {vae}, not {self.title}'s {self.vae_class}")
        self.check_scheduler(read_json(part_folder(cfg, "scheduler") / "scheduler_config.json"))
        self.check_widths(cfg)

    def check_widths(self, cfg) -> None:
        """The parts' shared widths (`widths`) equal, or the pair named before anything loads."""
        for takes, want, part, found in self.widths(cfg):
            if None not in (want, found) and want != found:  # a key absent: not checked
                raise ValueError(
                    f"the transformer's {takes} is {want}, and {part} gives {found}: {self.title}'s parts "
                    "are of different models (a VAE or text encoder of another release); use one release's "
                    "folder (model.pretrained, vae.pretrained, text_encoder.pretrained)"
                )

    def widths(self, cfg) -> list:
        """[(the transformer's config key, its value, which part's width it must equal, that width)] of its
        parts' shared widths, checked before anything loads (none by default)."""
        return []

    def check_file_names(self, cfg) -> None:
        """A single transformer file's names, mapped on meta tensors of its shapes (nothing is read), each
        with a place in the model and every parameter with a weight: or refused by name now, not after
        the whole file is read on every rank."""
        shapes = tensor_shapes(cfg.model.pretrained)
        state = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
        names = self.names.to_tessera(self.names.from_original(state))
        check_weight_names(cfg.model.pretrained, self.meta_transformer(cfg).state_dict(), names)

    def check_scheduler(self, config: dict) -> None:
        """Refuse (ValueError) a scheduler_config.json the family's schedule does not reproduce ({}: none)."""

    def refuse_scheduler(self, config: dict, wrong: list, how: str = "") -> None:
        """check_scheduler's refusal (ValueError) of a scheduler other than FlowMatchEulerDiscreteScheduler
        or with the `wrong` settings ("key=value"); `how`: the rest of what the family samples with."""
        kind = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if kind != "FlowMatchEulerDiscreteScheduler" or wrong:
            raise ValueError(
                f"{self.title} samples with FlowMatchEulerDiscreteScheduler{how}; the folder's scheduler is "
                f"{kind}{' with ' + ', '.join(wrong) if wrong else ''}"
            )

    def check_sample_keys(self, cfg) -> None:
        """Refuse by name (ValueError) a sampling setting the family cannot take, before anything starts
        (infer.py and train.py's previews). Another family's own keys were refused when the recipe loaded
        (models/recipe_keys.py)."""

    def check_negative(self, negative: str, where: str) -> None:
        """Refuse by name a negative prompt (`where`: the flag or key) a family without a negative branch
        would ignore (its pipeline takes none)."""
        if negative and self.guidance_embedded:
            raise ValueError(
                f"{where}={negative!r}: {self.title} embeds its guidance scale and has no negative branch "
                "(its pipeline takes no negative prompt); leave it empty"
            )

    def check_guidance(self, cfg, guidance: float) -> None:
        """Refuse (ValueError) a combination of the sampling's guidance scale (--guidance, else
        sample.guidance) and the recipe's other terms that the family does not sample."""

    def heads(self, cfg) -> int | None:
        """The attention heads Ulysses splits (model.pretrained's transformer's), or None when no operator
        splits heads (Ulysses is then a plain token split)."""
        return self.transformer_config(cfg).get("num_attention_heads", 1)

    def check_split(self, cfg, height: int, width: int, ulysses: int, ring: int) -> None:
        """Refuse (ValueError) a sequence split its operators cannot run, or a size too small for it."""

    def check_image_size(self, frames: int, height: int, width: int, multiple: int, why: str = "") -> None:
        """An image family's check_size: one frame, sides multiples of `multiple` (`why`: its reason)."""
        if frames != 1:
            raise ValueError(f"{self.title} samples images: use --frames 1 (got {frames})")
        if height % multiple or width % multiple:
            near = lambda n: n // multiple * multiple or multiple  # noqa: E731
            raise ValueError(
                f"{self.title} samples sizes that are multiples of {multiple}{why}: --height {height} "
                f"--width {width} is not (try {near(height)} x {near(width)})"
            )

    def check_size(self, cfg, frames: int, height: int, width: int) -> None:
        """Refuse a size the family cannot sample, naming the flag (ValueError)."""

    def text_encoder_class(self, cfg, default: str):
        """The transformers class of its text encoder as model_index.json names it (else `default`)."""
        import transformers

        index = read_json(Path(part_folder(cfg, "text_encoder")).parent / "model_index.json")
        return getattr(transformers, index.get("text_encoder", [0, default])[1])

    def build(self, config: dict, cfg) -> torch.nn.Module:
        """The transformer of a diffusers config.json (on whatever device is current)."""
        raise NotImplementedError

    def config_of_file(self, shapes: dict) -> dict:
        """The diffusers config of a single file from its tensors' shapes ({name as in the file: shape}),
        when no transformer/config.json comes with it."""
        raise ValueError(
            f"{self.title}: a single transformer file needs a pipeline folder whose transformer/config.json "
            "describes it: name it in vae.pretrained or text_encoder.pretrained"
        )

    def transformer_config(self, cfg) -> dict:
        """model.pretrained's transformer config.json; for a single .safetensors file, the transformer/
        config.json of the pipeline folder in vae.pretrained or text_encoder.pretrained (one of this
        family's transformer classes), else the one the file's shapes give."""
        if not is_single_file(cfg.model.pretrained):
            return read_json(part_folder(cfg, "transformer") / "config.json")
        for folder in (cfg.vae.pretrained, cfg.text_encoder.pretrained):
            config = read_json(Path(folder or "") / "transformer" / "config.json") if folder else {}
            if config.get("_class_name") in self.transformer_classes:
                return config
        return self.config_of_file(tensor_shapes(cfg.model.pretrained))

    def run_transformer(self, cfg, architecture: dict) -> torch.nn.Module:
        """The transformer a training run of the recipe trained, on the meta device, given the architecture
        its checkpoints record (what an export reads its adapters into)."""
        return self.meta_transformer(cfg)

    def calibration_parts(self, cfg, fingerprint) -> dict:
        """What a step-cache calibration depends on besides the transformer's weights (parallel/compute/
        cache.py calibration_subject): its text encoder's, VAE's and scheduler's configs, known by
        `fingerprint(files)` of their contents, not their paths."""
        configs = {name: sorted(part_folder(cfg, name).glob("*.json")) for name in ("text_encoder", "vae")}
        scheduler = sorted(part_folder(cfg, "scheduler").glob("*.json"))
        known = lambda files: fingerprint(files) if files else "none"  # noqa: E731
        return {
            "parts": f"text encoder {known(configs['text_encoder'])}, VAE {known(configs['vae'])}",
            "schedule": f"scheduler {known(scheduler)}",
        }

    def check_export(self, cfg, model, pipeline: bool) -> None:
        """What scripts/export.py's folder of `model` (the run's transformer, on the meta device) needs,
        checked before any weight is read: for a pipeline, model.pretrained's folder with its other parts."""
        if pipeline and not (Path(cfg.model.pretrained or "") / "model_index.json").is_file():
            raise ValueError(
                f"--pipeline copies model.pretrained's pipeline folder: {cfg.model.pretrained} is not one"
            )

    def export_transformer(self, cfg, model) -> torch.nn.Module:
        """The filled `model` as the diffusers transformer model.pretrained's folder holds."""
        import diffusers

        config = self.transformer_config(cfg)
        with torch.device("meta"):  # no second random copy of the weights on the host
            transformer = getattr(diffusers, config["_class_name"]).from_config(config)
        transformer.load_state_dict(self.names.to_diffusers(model.state_dict()), strict=True, assign=True)
        return transformer

    def export_pipeline(self, cfg, transformer, second=None):
        """A diffusers pipeline with `transformer` in, its other parts model.pretrained's; `second`: (the
        other expert's transformer, the boundary) of a family with expert_pair."""
        import diffusers

        return diffusers.DiffusionPipeline.from_pretrained(cfg.model.pretrained, transformer=transformer)

    def meta_transformer(self, cfg) -> torch.nn.Module:
        """model.pretrained's transformer on the meta device: names and shapes, before anything loads."""
        with torch.device("meta"):
            return self.build(self.transformer_config(cfg), cfg)

    def load_transformer(self, cfg, dtype, keep=None) -> torch.nn.Module:
        """model.pretrained's transformer (a diffusers folder's shards, or a single file in the original or
        diffusers names) in `dtype`, frozen, built on the meta device and filled in place. `keep(model)`:
        the part of it to fill (a PipeFusion stage's blocks), whose weights alone a folder's files give."""
        from safetensors.torch import load_file

        whole = self.meta_transformer(cfg)
        model = keep(whole) if keep is not None else whole
        if is_single_file(cfg.model.pretrained) and not self.names.lazy_files:  # fused tensors: read whole
            tensors = self.names.to_tessera(self.names.from_original(load_file(cfg.model.pretrained)))
            read = tensors.__getitem__
        else:  # names only first (a rename): a file that does not fit is named before anything is read
            tensors = named_handles(self.names, cfg)
            read = lambda name: tensors[name][0].get_tensor(tensors[name][1])  # noqa: E731
        check_weight_names(cfg.model.pretrained, whole.state_dict(), tensors)  # a weight with no place: named
        state = {name: read(name).to(dtype) for name in model.state_dict()}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    def read_lora(self, cfg, spec: str):
        """(models.lora_formats.LoRAUpdate, strength) of `FILE[:SCALE]` matched to model.pretrained's
        transformer: diffusers/PEFT names (with or without `transformer.`), ComfyUI's `diffusion_model.`,
        kohya's `lora_unet_`; a key that fits no layer is a LoRAFormatError naming it."""
        from models.lora_formats import match_lora, parse_lora_spec, read_file

        path, strength = parse_lora_spec(spec)
        projections, linears = self.projections(self.meta_transformer(cfg))
        tensors, config = read_file(path)
        return match_lora(tensors, projections, linears, path, config), strength

    def projections(self, model) -> tuple[dict, dict]:
        """(the projections of each Linear, {module: (in, out)}) of `model` under the names its LoRA files
        use (models/lora_formats.py): diffusers', one for one, and the original release's."""
        from models.lora_formats import model_projections, with_release_names

        projections, linears = model_projections(model, self.lora_names(model))
        names = self.names
        return with_release_names(projections, linears, names.to_original, names.from_original), linears

    def lora_names(self, model):
        """name -> its diffusers name, for `model`'s Linears (a family whose names depend on the model's
        own dimensions overrides it)."""
        return self.names.diffusers_name

    def geometry(self, cfg) -> tuple:
        """(its latent space, latents per token along (t, h, w)): for the bucket table and the training
        shift. An image family: one latent frame per frame, its transformer's patch across."""
        return self.latent_space(cfg), (1, self.patch(cfg), self.patch(cfg))

    def load(self, cfg, device, dtype, transformer: bool = True, keep=None, texts: bool = True) -> Components:
        """Its parts on `device` in `dtype`, frozen; transformer=False: all but the transformer (training
        builds and shards its own), Components.transformer None; `keep`: as load_transformer's; texts=False:
        no text encoder (Components.text_encoder None: training on stored conditionings)."""
        raise NotImplementedError

    def vae_scale(self, cfg) -> int:
        """Pixels per latent along height and width (its VAE's, read from vae/config.json)."""
        raise NotImplementedError

    def patch(self, cfg) -> int:
        """Latent pixels per token along height and width (the transformer's patch_size)."""
        return int(self.transformer_config(cfg).get("patch_size", 1))

    def latent_space(self, cfg):
        """The shape arithmetic of its latents (models/vae.py LatentSpace): images, one latent frame per
        frame, for the bucket table and the training shift."""
        from models.vae import LatentSpace

        space = LatentSpace()
        space.latent_channels = self.meta_transformer(cfg).in_channels
        space.spatial_stride = self.vae_scale(cfg)
        return space

    def encode_images(self, parts: Components, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, 1, H, W) in [-1, 1] -> the transformer's latents (B, C, 1, h, w) float32, normalised
        as the family's training scripts in diffusers normalise them (the mode of the VAE's posterior)."""
        raise NotImplementedError

    def encode(self, parts: Components, prompts: list, max_length: int, negative: bool = False):
        """The conditioning object its transformer takes for `prompts` (`negative`: the negative prompts,
        which some families format differently)."""
        raise NotImplementedError

    def encode_batch(self, parts: Components, prompts: list, max_length: int, batch: dict):
        """A training batch's conditioning (`batch`: the loader's, for what else the text reads: Qwen-Image-
        Edit's references): `encode`'s."""
        return self.encode(parts, prompts, max_length)

    def conditionings(self, parts: Components, sampling) -> tuple:
        """(cond, uncond) of a models/sampler.py Sampling (uncond None where it does not guide): its prompts
        and negative prompt encoded, then both given each prompt's frames where it has them, as the
        pipelines give them (Qwen-Image-Edit encodes its references with the text)."""
        prompts, size = sampling.prompts, sampling.size
        guided, negative = self.guidance.guided(sampling.guidance), [sampling.negative_prompt] * len(prompts)
        if parts.texts:  # encode_first's, on the host until their batch comes
            device = next(parts.vae.parameters()).device
            cond = joined([parts.texts[p] for p in prompts], device)
            uncond = joined([parts.texts[(n,)] for n in negative], device) if guided else None
        else:
            cond, uncond = self.encode(parts, prompts, sampling.max_length), None
            if guided:
                uncond = self.encode(parts, negative, sampling.max_length, negative=True)
        if sampling.images is not None:
            last = sampling.last_images
            cond, uncond = self.with_images(parts, sampling.images, size, cond, uncond, last_images=last)
        return cond, uncond

    def encode_first(self, parts: Components, prompts: list, negative: str | None, max_length: int) -> None:
        """texts_first: every prompt encoded alone (parts.texts; the negative prompt, where the sampling
        guides, under (negative,)), then the text encoder freed."""
        import gc

        host = torch.device("cpu")  # 15.7 MB a prompt for FLUX.2 dev: many prompts would crowd the GPU
        for prompt in dict.fromkeys(prompts):
            parts.texts[prompt] = joined([self.encode(parts, [prompt], max_length)], host)
        if negative is not None:
            uncond = self.encode(parts, [negative], max_length, negative=True)
            parts.texts[(negative,)] = joined([uncond], host)
        parts.text_encoder = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def sound_format(self, cfg) -> tuple | None:
        """(sample rate, channels) its training reads the clips' sound at (data.audio: the loader resamples
        each clip's track to it), or None when its training reads no sound."""
        return None

    def takes_images(self, cfg) -> bool:
        """Whether model.pretrained's folder samples from a given first frame (infer.py --image)."""
        return False

    def needs_images(self, cfg) -> bool:
        """Whether model.pretrained's folder samples only from a given first frame (--image required)."""
        return self.takes_images(cfg)

    def sampling_images(self, cfg, given: tuple, count: int, size: tuple, sized: bool, say=None) -> tuple:
        """(each prompt's first frame (PIL) or None, its last frame or None, height, width) of a sampling of
        `count` prompts at `size` (frames, height, width) from --image and --last-image (`given`: their
        paths, None where not given), refused by name where the folder takes no image or needs one. Without
        --height and --width (`sized` False), a pipeline that sizes the video from the image (image_size)
        gives the size (every image must pick the same), and `say(line)` tells."""
        from models.image_condition import first_frames

        paths, last = given
        if last:
            raise ValueError(
                f"{self.title} samples its pretrained or trained weights: --last-image is not supported for "
                "it yet"
            )
        if self.needs_images(cfg) and not paths:
            raise ValueError(
                f"model.pretrained={cfg.model.pretrained} is {self.title}'s image-to-video pipeline: give "
                "the first frame with --image (a PNG or JPEG file)"
            )
        if paths and self.capabilities.image_to_video and not self.takes_images(cfg):
            raise ValueError(
                f"--image: model.pretrained={cfg.model.pretrained} is {self.title}'s text-to-video pipeline; "
                "image-to-video samples its image-to-video pipeline's folder"
            )
        if paths and not self.takes_images(cfg):
            raise ValueError(
                f"{self.title} samples its pretrained or trained weights: --image is not supported for it yet"
            )
        _, height, width = size
        if not paths:
            return None, None, height, width
        images = first_frames(paths, count, "--image")
        if sized or self.image_size(cfg, images[0]) is None:
            return images, None, height, width
        sizes = {self.image_size(cfg, image) for image in images}
        if len(sizes) > 1:
            raise ValueError(
                f"--image: the images' shapes pick different video sizes ({sorted(sizes)}): give --height "
                "and --width (each image is cropped to them), or images of one shape"
            )
        height, width = sizes.pop()
        if say is not None:
            say(
                f"--image: sampling {width}x{height}, the size {self.title}'s image-to-video pipeline picks "
                "for the image (sample.height and sample.width are not used with --image: give --height and "
                "--width)"
            )
        return images, None, height, width

    def sampling_experts(self, cfg, guidance: float, random_weights: bool, loras: bool) -> tuple | None:
        """A second transformer that samples some of the steps (Wan 2.2's low-noise expert) as (its folder,
        the noise level where they switch, its guidance scale), or None."""
        return None

    def pair_experts(self, parts: Components, low, boundary: float, guidance_2: float) -> None:
        """Give `parts` the second transformer sampling_experts named (`low`, loaded on the host)."""
        raise NotImplementedError(f"{self.title} samples with one transformer")

    def image_size(self, cfg, image) -> tuple | None:
        """(height, width) its image-to-video pipeline samples for `image` (PIL) when no size is given;
        None: the pipeline takes the size it is given (the recipe's)."""
        return None

    def with_images(self, parts: Components, images: list, size: tuple, *conds, last_images=None) -> tuple:
        """`conds` (a conditioning, or None) given each sample's first frame (`images`, PIL; `last_images`:
        each one's last, for a family that takes them) for a video of `size` (frames, height, width), as its
        image-to-video pipeline gives them. models/sampler.py calls it before `noise`, which a family may
        have read what it keeps on `parts` (LTX-2's first latent frame, the DiT's image condition)."""
        raise NotImplementedError

    def given_frames(self, cfg) -> tuple:
        """The manifest keys (data/manifest.py IMAGE_KEYS: image, last_image) whose frames its training
        conditions on instead of the clip's own (encode_clips' `given`); the loader reads no others."""
        return ()

    def encode_clips(self, parts: Components, videos: torch.Tensor, sound, cond, given=(None, None)) -> tuple:
        """(x0, cond) of a training batch: `videos` (B, 3, T, H, W) in [-1, 1] encoded (encode_images), and
        the prompts' `cond` given whatever else of the clips the family trains on (`sound`: (B, channels,
        samples) at sound_format's rate with data.audio, else None; `given`: the (first, last) frames
        (B, 3, H, W) in [-1, 1] a manifest names, or None, for a family whose training reads them)."""
        return self.encode_images(parts, videos), cond

    def open_weights(self, cfg, model, folder=None) -> LazyWeights:
        """model.pretrained's transformer weights under `model`'s names, read lazily (row by row where the
        files allow): what parallel/build/init.py fills a sharded model from."""
        return FamilyWeights(self, cfg)

    def describe(self, cfg) -> str:
        """How the start-up line names the model."""
        return f"{self.title} ({cfg.model.pretrained})"

    def check_training_images(self, cfg, frame_counts, say=None) -> tuple:
        """The previews' (first, last) frames (PIL lists, or None) of a family whose image-to-video training
        takes them from sample.images / sample.last_images (tessera's DiT), checked with the clip lengths
        `frame_counts` before anything starts; `say(line)`: a warning. (None, None): none."""
        return None, None

    def with_preview_images(self, cfg, parts: Components, images: tuple) -> Components:
        """The parts that sample training's previews, given check_training_images' frames."""
        return parts

    def empty_conditioning(self, parts: Components, max_length: int) -> dict:
        """The empty prompt's stored conditioning (a dropped caption's, with data.latents), for a latents
        folder without empty.safetensors."""
        return self.store_conditioning(self.encode(parts, [""], max_length))[0]

    def default_lora_targets(self, cfg) -> tuple:
        """lora.targets when the recipe leaves them at tessera's DiT's (configs/auto.py): its own."""
        return self.lora_targets

    def training_record(self, cfg) -> dict:
        """{recipe key: value} of the keys that decide which parameters its training trains, kept in each
        checkpoint: a resume with other values is refused by name (parallel/checkpoints/checkpoint.py
        check_trained)."""
        return {}

    def latent_record(self, cfg) -> dict:
        """{name: value} of its own settings that change its stored conditioning, kept in a latents
        folder's meta.json (data/latents.py) and the stored previews' identity: training with other values
        is refused by name. {} at their defaults, so folders written before a key existed still read."""
        return {}

    def check_training(self, cfg) -> None:
        """Refuse (ValueError) by name a recipe its training cannot take (before anything starts)."""

    def trains_parameter(self, cfg, name: str) -> bool:
        """Whether the recipe trains the transformer's parameter `name` (an adapter's: its module's name
        first); the others stay frozen, out of the optimizer, bit for bit as loaded."""
        return True

    def store_conditioning(self, cond) -> list[dict]:
        """Each sample's conditioning as scripts/precompute_latents.py keeps it ({name: tensor}): of a
        (text, text_mask) conditioning, the real tokens, which lead (the padding is on the right)."""
        stored = []
        for i, text in enumerate(cond.text):
            real = len(text) if cond.text_mask is None else int(cond.text_mask[i].sum())
            if cond.text_mask is not None and not bool(cond.text_mask[i, :real].all()):
                raise ValueError(f"{self.title}: a prompt's real tokens do not lead its padded text")
            stored.append({"text": text[:real]})
        return stored

    def dropped_conditioning(self, parts: Components, max_length: int, batch: dict) -> dict:
        """What a sample's stored conditioning takes for its caption dropped, where that is not the empty
        prompt's (scripts/precompute_latents.py stores it as dropped_<name>): {} for most families."""
        return {}

    def load_conditioning(self, stored: list, max_length: int):
        """A batch's conditioning from stored samples, as `encode` gives it for their prompts: the text
        zero-padded to the longest, masked (None when nothing is padded)."""
        return self.conditioning(*padded([s["text"] for s in stored]))


class FamilyWeights(LazyWeights):
    """model.pretrained's transformer weights under the model's own names, read lazily: `read(name, start,
    stop)` gives rows start:stop of one parameter (float32) and reads only those bytes from a diffusers
    folder's shards or a single file (Names.lazy_files), so each rank of a sharded model reads its own rows
    (parallel/build/init.py `materialize`). A single file whose original names fuse tensors is read whole."""

    def __init__(self, family: Family, cfg):
        from safetensors.torch import load_file

        single = is_single_file(cfg.model.pretrained)
        self.folder = Path(cfg.model.pretrained) if single else part_folder(cfg, "transformer")
        if single and not family.names.lazy_files:
            state = family.names.to_tessera(family.names.from_original(load_file(cfg.model.pretrained)))
            self._tensors = {name: (lambda t=t: t) for name, t in state.items()}
            return
        names = named_handles(family.names, cfg)
        self._tensors = {name: (lambda h=h, k=k: h.get_slice(k)) for name, (h, k) in names.items()}

    def check_parameters(self, names, partial: bool = False) -> None:
        check_weight_names(self.folder, names, self._tensors, partial)

    def shape(self, name: str) -> tuple:
        tensor = self._tensors[name]()
        return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        tensor = self._tensors[name]()
        if not isinstance(tensor, torch.Tensor) and not tensor.get_shape():  # a scalar: no rows to slice
            return tensor[()].float().reshape(1)[start:stop]
        return tensor[start:stop].float()


def named_handles(names, cfg) -> dict:
    """model.pretrained's transformer tensors by name, none read: name -> (file handle, its key), renamed
    once over every file of a folder (FLUX.2's names count the blocks of the whole model), or over a single
    file whose from_original only renames (Names.lazy_files: LTX-2's release file, VAEs and all)."""
    from safetensors import safe_open

    single = is_single_file(cfg.model.pretrained)
    files = [cfg.model.pretrained] if single else transformer_files(part_folder(cfg, "transformer"))
    handles = [safe_open(str(file), framework="pt") for file in files]
    state = {key: (handle, key) for handle in handles for key in handle.keys()}
    return names.to_tessera(names.from_original(state) if single else state)


def padded(rows: list) -> tuple:
    """(tokens (B, L, D): each of `rows` (L_i, D) zero-padded to the longest, mask (B, L) bool, None when
    nothing is padded)."""
    length = max(len(r) for r in rows)
    out = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)], mask[i, : len(r)] = r, True
    return out, None if bool(mask.all()) else mask


def joined(conds: list, device):
    """Conditionings of one prompt each as one batch on `device`: their tensor fields side by side (of one
    shape: the families whose texts have a fixed length)."""
    cat = lambda name: torch.cat([getattr(c, name) for c in conds]).to(device)  # noqa: E731
    names = [n for n in shared_fields(type(conds[0])) if getattr(conds[0], n) is not None]
    return replace(conds[0], **{name: cat(name) for name in names})


def shared_fields(conditioning) -> list:
    """The fields of a family's conditioning class that travel between ranks: its tensors (LTX-2's frame
    rate and flags are the recipe's, alike on every rank)."""
    tensor = re.compile(r"(<class ')?torch\.Tensor('>)?( \| None)?")  # the annotation, as a string or a type
    kinds = {f.name: str(f.type) for f in fields(conditioning)}
    odd = [name for name, kind in kinds.items() if "Tensor" in kind and not tensor.fullmatch(kind)]
    if odd:  # a tensor spelled otherwise would stay behind on the first rank, silently
        raise TypeError(f"{conditioning.__name__}: annotate {odd} as torch.Tensor or torch.Tensor | None")
    return [name for name, kind in kinds.items() if tensor.fullmatch(kind)]


def config_of(cfg, part: str) -> dict:
    """A part's config.json (a text encoder's text_config where it has one: a vision-language model's)."""
    config = read_json(part_folder(cfg, part) / "config.json")
    return config.get("text_config") or config


def read_json(path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def folder_classes(folder) -> set:
    """The diffusers class names a folder declares: model_index.json's, its config.json's and its
    transformer/config.json's."""
    folder = Path(folder)
    names = (folder / "model_index.json", folder / "config.json", folder / "transformer" / "config.json")
    return {read_json(path).get("_class_name") for path in names} - {None}


def component_folder(path, name: str) -> Path:
    """`path`'s `name`/ subfolder when it is a pipeline folder holding one, else `path` itself."""
    path = Path(path)
    return path / name if (path / name).is_dir() else path


def part_folder(cfg, name: str) -> Path:
    """The folder of a pipeline part (transformer, vae, text_encoder, tokenizer, scheduler): vae.pretrained
    for the VAE, text_encoder.pretrained for the text encoder and tokenizer, when set, else
    model.pretrained (when it is a single transformer file: vae.pretrained's, else text_encoder.pretrained's
    folder); its `name`/ subfolder when it has one."""
    given = {"vae": cfg.vae.pretrained, "text_encoder": cfg.text_encoder.pretrained}
    given["tokenizer"] = given["text_encoder"]
    base = cfg.model.pretrained
    if is_single_file(base):  # the first of the two folders that has the part, else the first given
        folders = [f for f in (cfg.vae.pretrained, cfg.text_encoder.pretrained) if f]
        base = next((f for f in folders if (Path(f) / name).is_dir()), folders[0] if folders else base)
    return component_folder(given.get(name) or base, name)


def is_single_file(path) -> bool:
    """Whether model.pretrained names one transformer file (.safetensors) rather than a folder."""
    return bool(path) and str(path).endswith(".safetensors") and Path(path).is_file()


def transformer_files(folder) -> list:
    """A diffusers transformer folder's weight files: those its index names (sharded), else the plain
    diffusion_pytorch_model.safetensors; one variant's (.fp16., .bf16.) only when there is nothing else.
    Missing shards and several variants are refused by name (FileNotFoundError, ValueError)."""
    folder = Path(folder)
    files = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    plain = [f for f in files if re.fullmatch(r"diffusion_pytorch_model(-\d+-of-\d+)?\.safetensors", f.name)]
    indexed = read_json(folder / "diffusion_pytorch_model.safetensors.index.json").get("weight_map", {})
    named = sorted({folder / name for name in indexed.values()})
    missing = [f.name for f in named if not f.is_file()]
    if named and len(missing) < len(named):  # an index with some of its shards: a broken download
        if missing:
            raise FileNotFoundError(f"{folder}: the index names {', '.join(missing)}, which are not there")
        return named
    if plain:
        return plain
    variants = {f.name.split(".")[1].split("-")[0] for f in files}
    if len(variants) > 1:
        raise ValueError(
            f"{folder} holds the weights in several variants ({', '.join(sorted(variants))}) and no plain "
            "diffusion_pytorch_model.safetensors: keep one"
        )
    return files


def tensor_shapes(path) -> dict:
    """{name: shape} of a .safetensors file, from its header (nothing else is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
