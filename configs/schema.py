"""The typed schema: every recipe key and its default; a family's own keys (its dimensions, its guidance
terms) are declared in models/<family>/keys.py and added to their sections here (_with_family_keys).

Recipes (`configs/*.yaml`) hold only what differs from these defaults; command-line dot-list
overrides (`train.max_steps=10`) come last. `configs.load_config` merges the three and turns
unknown keys and wrong types into errors that name the key.
"""

from dataclasses import dataclass, field, make_dataclass
from typing import Optional

from models.families import family_keys
from models.lora import DEFAULT_TARGETS
from models.vae import DEFAULT_OVERLAP, DEFAULT_TILE


@dataclass
class RunConfig:
    output_dir: str = "runs/default"  # the run directory: config, metrics, checkpoints, samples


@dataclass
class ModelConfig:
    # a key of models.dit.transformer.DiT_models; auto: every architecture key from model.pretrained
    size: str = "DiT-S"
    # dit (tessera's DiT, which reads Wan folders) | qwen_image | sana (models/families.py); auto: the
    # family model.pretrained's folder declares under model.size=auto, else dit. Resolved when loaded.
    family: str = "auto"
    # sdpa | math | xformers | flash | auto (the fastest kernel that runs each call's shapes, measured once:
    # SDPA's cuDNN, flash, memory-efficient and math kernels, flash-attn and xformers where installed;
    # docs/internals.md)
    attention_backend: str = "sdpa"
    # t2v | i2v: conditioned on a first frame (the input also takes a 4-channel mask and the frame's
    # latent, Wan I2V's 36 channels) | flf2v: on a first and a last frame | ti2v: Wan2.2 TI2V-5B, text-
    # to-video, or with an image its clean latent replaces the first latent frame, whose tokens get t = 0
    # (diffusers' expand_timesteps; training gives each clip its own first frame) (docs/image_to_video.md)
    task: str = "t2v"
    # A diffusers WanTransformer3DModel folder (config.json + safetensors): its weights, read shard by shard;
    # the recipe must build the same architecture (e.g. model.size=Wan2.1-1.3B). Or a tessera run (its
    # directory, checkpoints/, `latest` or a step_<N>): the EMA weights of that checkpoint.
    pretrained: Optional[str] = None
    # A LoRA run's frozen base: auto (the compute dtype: bf16 on a GPU) | float8 (the blocks' Linear weights
    # in float8 with a scale per row, computed in the compute dtype: half the base's bytes; infer.py too
    # samples on it, the run's adapters and --lora files kept beside the quantized layers; models/float8.py)
    base_dtype: str = "auto"


@dataclass
class VAEConfig:
    # identity (pixel space) | kl (diffusers AutoencoderKL, images) | wan (AutoencoderKLWan, video)
    kind: str = "identity"
    pretrained: Optional[str] = None  # a local folder for from_pretrained; None builds a tiny random VAE
    seed: int = 0  # seed of the tiny random VAE, so training and sampling build the same one
    tiny_base_dim: int = 16  # width of the tiny random VAE
    tiny_latent_channels: int = 4
    # Decode (and encode) in spatial tiles (models/tiling.py), dealt across ranks (parallel/compute/vae.py):
    # the largest tile side and the overlap blended between neighbours, in latent pixels. 32 / 8 is diffusers'
    # AutoencoderKLWan tiling (256 px tiles, 192 px stride at stride 8): Wan's 480 x 832 latent becomes
    # 3 x 4 = 12 tiles, enough for 2, 3, 4, 6 or 12 ranks to share evenly. For the SD-family VAEs diffusers
    # tiles at 512 px with 25% overlap: tile_latent=64, tile_overlap=16 matches that. A latent no larger
    # than one tile is decoded whole (the tiny demo VAEs always are): a large tile_latent turns tiling off.
    tile_latent: int = DEFAULT_TILE
    tile_overlap: int = DEFAULT_OVERLAP


@dataclass
class TextEncoderConfig:
    kind: str = "t5"  # t5 | umt5 | clip
    pretrained: Optional[str] = None  # a local folder; None builds a tiny random T5 with the ByT5 tokenizer
    max_length: int = 64  # tokens kept per prompt (longer prompts are truncated)
    seed: int = 0  # seed of the tiny random encoder
    tiny_d_model: int = 32
    tiny_layers: int = 2
    cache_size: int = 256  # prompt embeddings kept in memory (a UMT5-XXL prompt is 4 MiB at 256 tokens)


@dataclass
class ImageEncoderConfig:
    # model.task=i2v/flf2v with model.image_dim: a local CLIPVisionModel folder (with its
    # CLIPImageProcessor), or a WanImageToVideoPipeline folder (its image_encoder/ and image_processor/);
    # None: model.pretrained's, if it is such a pipeline folder
    pretrained: Optional[str] = None


@dataclass
class DataConfig:
    manifest: Optional[str] = (
        None  # JSONL manifest or a folder of media with .txt captions; None: the synthetic demo
    )
    latents: Optional[str] = (
        None  # a folder from scripts/precompute_latents.py: train on latents, no decoding
    )
    frames: int = 9  # the default clip size (and preview size): frames x height x width
    height: int = 32
    width: int = 32
    # Buckets (data/buckets.py); left empty, the one bucket is frames x height x width.
    resolutions: list[int] = field(
        default_factory=list
    )  # pixel budgets as the side of a square: 256 = 256x256 pixels
    aspect_ratios: list[str] = field(default_factory=list)  # width:height, e.g. ["1:1", "16:9", "9:16"]
    frame_counts: list[int] = field(default_factory=list)  # clip lengths (1: images); each must suit the VAE
    max_upscale: float = 1.0  # a sample is never enlarged by more than this to reach its bucket (1.0: never)
    tokens_per_batch: int = (
        0  # per-rank batch size of a bucket = this // its tokens; 0: train.batch_size for all
    )
    max_batch_size: int = 0  # cap on every bucket's batch size; 0: no cap
    epoch_remainder: str = "pad"  # batches beyond a multiple of dp: pad (repeat whole batches) | drop
    on_plan_change: str = (
        "error"  # resuming after dp or the data changed: error | new_epoch (skip the epoch's rest)
    )
    fps: Optional[float] = None  # resample videos to this rate; None keeps the file's rate
    # a manifest whose missing files (probed, or stat'ed where its lines carry sizes) exceed this share of
    # its files is refused at start-up (a wrong path or an unmounted disk); below it, training goes on
    max_missing_fraction: float = 0.2
    # clips must carry sound (for a family whose training reads it: LTX-2; others refuse it by name); a clip
    # without it is refused at start-up, naming it, from the manifest's "audio" key (scripts/index_folder.py).
    # Each sample then carries its frames' sound (frames / data.fps seconds): data.fps is required
    audio: bool = False
    num_workers: int = 2
    synthetic_samples: int = 4096  # size of one epoch of the synthetic dataset
    synthetic_seed: int = 0
    # colours of the synthetic clips; None: the demo's six. scripts/demo_lora.sh adds one they lack (orange)
    synthetic_colors: Optional[list[str]] = None


@dataclass
class FlowConfig:
    logit_mean: float = 0.0  # logit-normal timestep density (SD3: lognorm(0, 1))
    logit_std: float = 1.0
    shift: float = 1.0  # timestep shift at shift_reference_tokens tokens
    shift_reference_tokens: int = (
        256  # shift grows with sqrt(tokens / this) (SD3, section 5.3.2); 0: fixed (Wan)
    )


@dataclass
class TrainConfig:
    max_steps: int = 1000
    batch_size: int = 8  # per data-parallel rank
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 100
    # after warm-up: constant | cosine (down to 0 at max_steps)
    # | linear (constant, then straight down to 0 over the last decay_fraction of max_steps; a tail longer
    # than the steps after warm-up cuts the warm-up short); both move with max_steps on a resume
    lr_decay: str = "constant"
    decay_fraction: float = 0.2  # with lr_decay=linear only: refused by name where lr_decay is another
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    text_dropout: float = 0.1  # probability of training on the empty prompt (classifier-free guidance)
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 3  # older step_<N> folders are deleted once a newer one is complete
    sample_every: int = 0  # 0: only at the end
    seed: int = 0
    # auto (continue from latest if present) | none | a step_<N> folder, latest file, checkpoints/ or run dir
    resume: str = "auto"
    activation_checkpointing: bool = False
    # with activation_checkpointing: all (each block's forward recomputed in backward) | selective (the
    # matmul, attention and convolution outputs kept, the elementwise work recomputed: more memory, less time)
    checkpoint_policy: str = "all"
    compile: bool = False
    # FSDP2's CPU offload: sharded weights, gradients and AdamW in CPU memory, each block copied in for its
    # forward and backward. For a LoRA run whose frozen base does not fit the GPU (docs/lora.md).
    cpu_offload: bool = False
    # with activation_checkpointing (checkpoint_policy all): the checkpointed blocks' inputs, and what else
    # the forward keeps for backward outside them, in host memory (pinned), copied back in backward
    # (parallel/compute/fsdp.py offloaded_activations): the blocks' inputs leave the GPU (Wan2.1-14B at
    # 32,760 tokens: 12.5 GiB), for a copy each way per step
    activation_offload: bool = False
    # At start-up the recipe's peak memory is modelled on the meta device (parallel/lifecycle/memory.py) and a
    # run that cannot fit its GPU or host is refused, naming what would fit; false skips the check (the model
    # is an estimate). The watch on host memory during the run stays.
    memory_check: bool = True
    # manual: activation_checkpointing, checkpoint_policy and cpu_offload as the recipe sets them | auto: the
    # fastest of them that the start-up memory model fits in the GPU (on a CPU: the host): no checkpointing,
    # then selective, then all, then all with activation_offload, then all with cpu_offload (one GPU), with
    # both; the start-up line and config.yaml say which was chosen
    memory: str = "manual"
    # torchao's float8 matmuls for the blocks' Linear layers whose smaller side is at least
    # fp8_min_features (smaller ones lose more to the casts than the matmul gains); weights, gradients and
    # AdamW as before. A GPU of compute capability 8.9+ (emulated on a CPU); pip install -e ".[fp8]"
    fp8: bool = False
    fp8_min_features: int = 1024
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # a step whose gradient norm is NaN or inf: stop (the run ends, naming it, before saving anything
    # non-finite) | skip (no update for that step; costs one host sync per step; 20 in a row stop the run)
    on_nonfinite: str = "stop"
    # the range a checkpoint must be saved in to be the "last good checkpoint" a diverged run recommends:
    # the loss logged last (a model that predicts zero scores ~2 on unit-variance latents) and the largest
    # |weight| of the trained parameters. Out of range is only recorded (and said), never a stop.
    loss_limit: float = 10.0
    weight_limit: float = 1.0e4
    # flow: the flow-matching loss on the data | dmd: distil model.pretrained (the teacher) into a few-step
    # student that samples without guidance (distribution matching, DMD2; the distill section;
    # docs/distill.md)
    objective: str = "flow"


@dataclass
class SampleConfig:
    steps: int = 30
    guidance: float = 5.0
    negative_prompt: str = ""
    use_ema: bool = True
    prompts: list[str] = field(
        default_factory=lambda: ["a red square moving left"]
    )  # previews during training
    # image-to-video previews (model.task=i2v / flf2v): each prompt's first (last) frame, or one for all
    images: list[str] = field(default_factory=list)
    last_images: list[str] = field(default_factory=list)
    frames: Optional[int] = None  # None: data.frames
    height: Optional[int] = None  # None: data.height
    width: Optional[int] = None  # None: data.width
    fps: int = 8  # frame rate of written videos (LTX-2: its frame_rate too, for positions and audio length)
    # infer.py: prompts sampled at once per data-parallel replica, each batch written as it finishes. Memory
    # grows with it (DiT-S: 0.61 GB for 1 prompt, 1.12 GB for 16); 4 keeps it bounded, still batches small
    # models, and samples up to 4 prompts as one run always did. A large video DiT (Wan 14B at 720p), whose
    # one sample fills a GPU: 1. The videos do not depend on it (prompt i: seed + i, whatever its batch).
    batch_size: int = 4
    # step cache (infer.py; docs/step_cache.md): none; calibrated: skip the steps whose velocity a
    # calibration (scripts/calibrate_cache.py) says barely changes, reusing the last one (the plan is the
    # same on every rank by construction); first_block: skip the blocks after the first while its residual
    # barely changes (the ranks add up the signal in one tiny all-reduce). Previews stay uncached.
    cache: str = "none"
    cache_threshold: float = 0.3  # calibrated: summed relative velocity change a run of skips may cover
    cache_first_block_threshold: float = 0.15  # first_block: relative change of the first block's residual
    cache_max_skips: int = 2  # at most this many steps skipped in a row
    cache_calibration: Optional[str] = None  # the JSON file scripts/calibrate_cache.py writes


@dataclass
class ParallelConfig:
    dp: int = -1  # data parallel (FSDP2); -1: whatever the other degrees leave of the world size
    cfg: int = 1  # classifier-free-guidance parallel (sampling only)
    pipefusion: int = (
        1  # PipeFusion stages (sampling only): the blocks split into this many contiguous stages
    )
    pipefusion_patches: Optional[int] = (
        None  # patches of whole token rows pipelined through the stages; None: pipefusion
    )
    pipefusion_warmup: int = (
        1  # first steps run whole-sequence (synchronous), filling every layer's K/V buffer
    )
    ulysses: int = 1  # Ulysses sequence parallel
    ring: int = 1  # Ring sequence parallel
    # choose the degrees dp leaves: ulysses then ring (training); cfg, ulysses, ring, pipefusion (sampling)
    auto: bool = False
    # timeout of every collective; also the deadline of start-up, the first step, checkpoints, previews
    timeout_s: float = 600.0
    stall_timeout_s: Optional[float] = (
        None  # a later step making no progress this long is a stall; None: 300 GPU, 120 CPU
    )
    heartbeat_timeout_s: float = (
        10.0  # a rank whose heartbeat is silent this long is gone (killed, stopped, host lost)
    )
    control_timeout_s: float = 1800.0  # the gloo control group that fences long single-rank work
    preflight_timeout_s: float = 60.0  # the first collective at start-up; a hang here is a transport problem
    max_message_mb: float = 256.0  # collectives above this size are split into chunks


@dataclass
class LoRAConfig:
    """Low-rank adapters on a frozen base (model.pretrained); docs/lora.md."""

    rank: int = 0  # 0: full fine-tuning; r > 0: train rank-r adapters only
    alpha: Optional[float] = None  # the update is scaled by alpha / rank; None: alpha = rank (scale 1)
    # fnmatch patterns of the Linear layers that get adapters (tessera's module names, e.g.
    # blocks.3.attn.qkv); the default: every Linear of the blocks' self-attention, cross-attention and MLP
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    dropout: float = 0.0  # dropout on the adapters' input (not reproducible across layouts when > 0)
    seed: int = 0  # the adapters' initialisation (A from (seed, name); B starts at 0)
    # a fused Linear (q, k, v in one; cross-attention k, v) gets one rank-r adapter per projection, as
    # PEFT and every LoRA file have them; false: one shared A (runs saved before this key existed)
    per_projection: bool = True
    # start the adapters from a LoRA file (.safetensors: diffusers/PEFT, ComfyUI/Wan or kohya/musubi
    # names) instead of lora.seed; a fresh start only: a resume takes the checkpoint's adapters
    init_from: Optional[str] = None


@dataclass
class DistillConfig:
    """train.objective=dmd (docs/distill.md): the student (the generator) and the critic are two LoRAs
    (lora.rank) on one frozen base, model.pretrained, which is the teacher with both switched off; with
    lora.rank=0, full copies of it beside the frozen teacher."""

    steps: int = 4  # the student's sampling steps (the family's schedule at this count: its sigmas)
    guidance: Optional[float] = None  # the teacher's guidance scale; None: sample.guidance of the recipe
    critic_updates: int = 5  # critic updates per generator update (DMD2's two time-scale rule)
    critic_lr: Optional[float] = None  # the critic's learning rate (same schedule); None: train.lr
    # the noise levels of the matching loss and the critic's loss: u uniform in [min_sigma, max_sigma],
    # shifted as training shifts (flow.shift at flow.shift_reference_tokens) unless shift is set
    min_sigma: float = 0.02
    max_sigma: float = 0.98
    shift: Optional[float] = None


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "tessera"
    # TensorBoard event files in <run>/tensorboard (metrics and previews); pip install -e ".[tensorboard]"
    tensorboard: bool = False


def _with_family_keys(cls, section: str):
    """`cls` with the families' own keys of its section (models/<family>/keys.py) as fields after its own."""
    added = [
        (k.name, k.type, field(default_factory=lambda v=k.default: list(v)))
        if isinstance(k.default, list)
        else (k.name, k.type, field(default=k.default))
        for k in FAMILY_KEYS
        if k.section == section
    ]
    return make_dataclass(cls.__name__, added, bases=(cls,)) if added else cls


FAMILY_KEYS = family_keys()
ModelConfig = _with_family_keys(ModelConfig, "model")
TrainConfig = _with_family_keys(TrainConfig, "train")
SampleConfig = _with_family_keys(SampleConfig, "sample")
DistillConfig = _with_family_keys(DistillConfig, "distill")


@dataclass
class TesseraConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    image_encoder: ImageEncoderConfig = field(default_factory=ImageEncoderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
