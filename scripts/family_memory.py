"""Memory per GPU of the model families' recipes on 1 and 8 GPUs, counted on the meta device (activations
not counted): sampling (every part in bf16 on every rank; under PipeFusion each GPU holds its stage's share
of the transformer), full fine-tuning (20 bytes a transformer parameter: float32 weights, gradients, AdamW's
moments, EMA, sharded by FSDP2; text encoder and VAE in bf16 on every rank) and LoRA (the base in bf16,
sharded; rank-LORA_RANK adapters on the family's lora.targets, 20 bytes a parameter), also from precomputed
latents (data.latents: no text encoder; the other frozen parts stay) and on a float8 base
(model.base_dtype=float8: the blocks' Linear weights a byte each, a scale per row), which sampling takes too.

    python scripts/family_memory.py [--json out.json]  (--tiny: the tests' tiny configs, seconds)

Configs: diffusers' defaults for the transformers and VAEs (the releases'; Sana's DC-AE is ~0.3B, 0.1 GiB
under diffusers' default), the released text encoders' written out here, checked against their cards.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

GiB, BF16 = 2**30, 2
TRAINED = 20  # bytes per trained parameter: float32 weight, gradient, AdamW's two moments, EMA
LORA_RANK = 32
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct)
QWEN_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
)
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584)
CARD_BILLIONS = {
    "Qwen-Image transformer": 20.4,
    "Qwen2.5-VL-7B": 8.29,
    "Sana 1600M transformer": 1.6,
    "Gemma-2-2B": 2.61,
    "HunyuanVideo 1.5 transformer": 8.3,
    "LTX-2 transformer": 19.0,  # LTX-2's card: a 19B audio-video model
    "Z-Image transformer": 6.15,  # Z-Image's card: 6B
    "Qwen3-4B": 4.02,
}
# Qwen/Qwen3-4B's config.json (Z-Image's text encoder, loaded as Qwen3Model)
QWEN3_4B = dict(
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip
# mistralai/Mistral-Small-3.1-24B's text model (FLUX.2 dev's text encoder; its 0.4B vision tower not counted)
MISTRAL_SMALL_TEXT = dict(
    hidden_size=5120, intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=131072,
)  # fmt: skip
# black-forest-labs/FLUX.1-dev's vae/config.json (Z-Image's VAE)
FLUX_VAE = dict(
    block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2, latent_channels=16, use_quant_conv=False,
    use_post_quant_conv=False,
)  # fmt: skip
# google/gemma-3-12b-it's config.json (LTX-2's text encoder, loaded whole: Gemma3ForConditionalGeneration)
GEMMA3_12B_TEXT = dict(
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    vocab_size=262208,
)
GEMMA3_VISION = dict(  # its SigLIP so400m vision tower
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
    patch_size=14,
)  # fmt: skip
# google/byt5-small's encoder (HunyuanVideo 1.5's glyph encoder is a ByT5-small fine-tune: d_model 1472)
BYT5_SMALL = dict(
    vocab_size=384,
    d_model=1472,
    d_ff=3584,
    num_layers=12,
    num_heads=6,
    d_kv=64,
    feed_forward_proj="gated-gelu",
)


def release_parts(only=None) -> dict:
    """{family: {part: module on the meta device}} at the releases' configs (transformer, text encoder,
    VAE); `only`: those families alone (each takes seconds to build)."""
    import torch
    from diffusers import (
        AutoencoderDC,
        AutoencoderKL,
        AutoencoderKLFlux2,
        AutoencoderKLHunyuanVideo15,
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        AutoencoderKLQwenImage,
        Flux2Transformer2DModel,
        HunyuanVideo15Transformer3DModel,
        LTX2VideoTransformer3DModel,
        QwenImageTransformer2DModel,
        SanaTransformer2DModel,
        ZImageTransformer2DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import (
        Gemma2Config,
        Gemma2Model,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        MistralConfig,
        MistralModel,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        Qwen3Config,
        Qwen3Model,
        T5Config,
        T5EncoderModel,
    )

    qwen_text = Qwen2_5_VLConfig(
        text_config=QWEN_TEXT,
        vision_config=QWEN_VISION,
        vocab_size=152064,
        hidden_size=3584,
        tie_word_embeddings=False,
    )
    builders = {
        "Qwen-Image": lambda: {
            "Qwen-Image transformer": QwenImageTransformer2DModel(),
            "Qwen2.5-VL-7B": Qwen2_5_VLForConditionalGeneration(qwen_text),
            "AutoencoderKLQwenImage": AutoencoderKLQwenImage(),
        },
        "Sana 1600M": lambda: {
            "Sana 1600M transformer": SanaTransformer2DModel(),
            "Gemma-2-2B": Gemma2Model(Gemma2Config()),  # its defaults are Gemma-2-2B's
            "DC-AE (diffusers' defaults)": AutoencoderDC(),
        },
        "LTX-2": lambda: {  # the video VAE last
            "LTX-2 transformer": LTX2VideoTransformer3DModel(),
            "Gemma-3-12B": Gemma3ForConditionalGeneration(
                Gemma3Config(text_config=GEMMA3_12B_TEXT, vision_config=GEMMA3_VISION)
            ),
            "connectors": LTX2TextConnectors(),
            "AutoencoderKLLTX2Audio": AutoencoderKLLTX2Audio(),
            "vocoder": LTX2Vocoder(),
            # the release's 32 x 32 x 8 pixels a latent (diffusers' defaults derive 64 x 64 x 16)
            "AutoencoderKLLTX2Video": AutoencoderKLLTX2Video(
                spatial_compression_ratio=32, temporal_compression_ratio=8
            ),
        },
        "HunyuanVideo 1.5": lambda: {  # the transformer first, the VAE last (per_gpu)
            "HunyuanVideo 1.5 transformer": HunyuanVideo15Transformer3DModel(),
            "Qwen2.5-VL-7B text model": Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN_TEXT)),
            "ByT5-small encoder": T5EncoderModel(T5Config(**BYT5_SMALL)),
            "AutoencoderKLHunyuanVideo15": AutoencoderKLHunyuanVideo15(),
        },
        "FLUX.2 klein 4B": lambda: {  # black-forest-labs/FLUX.2-klein-4B's transformer/config.json
            "FLUX.2 klein 4B transformer": Flux2Transformer2DModel(
                num_layers=5,
                num_single_layers=20,
                num_attention_heads=24,
                joint_attention_dim=7680,
                guidance_embeds=False,
            ),
            "Qwen3-4B": Qwen3Model(Qwen3Config(**QWEN3_4B)),
            "AutoencoderKLFlux2": AutoencoderKLFlux2(),
        },
        "FLUX.2 dev": lambda: {  # diffusers' Flux2Transformer2DModel defaults: the dev release's 32B
            "FLUX.2 dev transformer": Flux2Transformer2DModel(),
            "Mistral-Small-3.1-24B text model": MistralModel(MistralConfig(**MISTRAL_SMALL_TEXT)),
            "AutoencoderKLFlux2": AutoencoderKLFlux2(),
        },
        "Z-Image": lambda: {
            "Z-Image transformer": ZImageTransformer2DModel(),
            "Qwen3-4B": Qwen3Model(Qwen3Config(**QWEN3_4B)),
            "FLUX's AutoencoderKL": AutoencoderKL(**FLUX_VAE),
        },
    }
    with torch.device("meta"):
        return {name: build() for name, build in builders.items() if only is None or name in only}


def tiny_parts() -> dict:
    """The tests' tiny pipelines' parts (tests/test_families.py), built here."""
    from tests.test_flux2 import tiny_flux2_pipeline
    from tests.test_hunyuan_video15 import tiny_pipeline
    from tests.test_ltx2_pipeline import tiny_pipeline as tiny_ltx2_pipeline
    from tests.test_qwen_image import tiny_qwen_pipeline
    from tests.test_sana import tiny_sana_pipeline
    from tests.test_z_image import tiny_z_image_pipeline

    qwen, sana, hunyuan = tiny_qwen_pipeline(), tiny_sana_pipeline(), tiny_pipeline()
    parts = {
        name: {f"{name} {part}": getattr(pipe, part) for part in ("transformer", "text_encoder", "vae")}
        for name, pipe in (
            ("Qwen-Image", qwen),
            ("Sana", sana),
            ("Z-Image", tiny_z_image_pipeline()),
            ("FLUX.2", tiny_flux2_pipeline()),
        )
    }
    names = ("transformer", "text_encoder", "text_encoder_2", "vae")
    parts["HunyuanVideo 1.5"] = {f"HunyuanVideo 1.5 {part}": getattr(hunyuan, part) for part in names}
    ltx2 = tiny_ltx2_pipeline()
    names = ("transformer", "text_encoder", "connectors", "audio_vae", "vocoder", "vae")
    parts["LTX-2"] = {f"LTX-2 {part}": getattr(ltx2, part) for part in names}
    return parts


def family_of(name: str):
    """The family (models/families.py) a row of this table is about."""
    from models.families import FAMILIES

    return max((f for f in FAMILIES.values() if name.startswith(f.title)), key=lambda f: len(f.title))


def lora_counts(family_name: str, transformer, rank: int) -> tuple:
    """(parameters of rank-`rank` adapters on the family's lora.targets, bytes of the frozen base under
    model.base_dtype=float8: the blocks' Linear weights in float8 with a float32 scale per row, the rest
    in bf16) of tessera's transformer of `transformer`'s config (meta device)."""
    import torch

    from models.float8 import quantize_blocks
    from models.lora import add_adapters, is_adapter

    family = family_of(family_name)
    recipe = SimpleNamespace(model=SimpleNamespace(attention_backend="sdpa"))
    with torch.device("meta"):
        model = family.build(dict(transformer.config), recipe)
        add_adapters(model, rank, rank, list(family.lora_targets))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    quantize_blocks(model)
    named = list(model.named_parameters())
    base = sum(p.numel() * (p.element_size() if p.element_size() < 4 else BF16) for n, p in named
               if not is_adapter(n) and not n.endswith("weight_scale"))  # fmt: skip
    scales = sum(p.numel() * 4 for n, p in named if n.endswith("weight_scale"))
    return sum(p.numel() for n, p in named if is_adapter(n)), base + scales


def per_gpu(counts: dict, adapters: int, gpus: int, texts_first: bool = False, float8: int = 0) -> dict:
    """GiB per GPU of each recipe on `gpus` GPUs (`counts`: the transformer first, the text encoders, the
    VAE last). PipeFusion: the mean over its stages of the transformer (the blocks hold all but a few of
    its weights; a stage holds one block more than another where the depth does not divide). `texts_first`
    (Loading.texts_first): sampling holds the text encoders or the transformer, never both. `float8`: the
    base's bytes under model.base_dtype=float8 (lora_counts)."""
    model, *texts, vae = counts.values()
    frozen = (sum(texts) + vae) * BF16
    lora = (model * BF16 + adapters * TRAINED) / gpus
    sample = (max(model, sum(texts)) + vae) * BF16 if texts_first else model * BF16 + frozen
    sample8 = max(float8, sum(texts) * BF16) + vae * BF16 if texts_first else float8 + frozen
    return {
        "sample": sample / GiB,
        "sample-float8": sample8 / GiB,
        "sample-pipefusion": (model * BF16 / gpus + frozen) / GiB,
        "full": (model * TRAINED / gpus + frozen) / GiB,
        "lora": (lora + frozen) / GiB,
        # data.latents from precompute_latents.py, which stores the previews' conditionings too: the text
        # encoder is never read (other preview prompts than the folder's would load it first, for a while)
        "lora-latents": (lora + frozen - texts[0] * BF16) / GiB,
        "lora-float8-latents": ((float8 + adapters * TRAINED) / gpus + frozen - texts[0] * BF16) / GiB,
    }


def main(argv=None) -> None:
    args = benchlib.parse_args(benchlib.parser(__doc__), argv)
    parts = tiny_parts() if args.tiny else release_parts()
    rank = 4 if args.tiny else LORA_RANK  # the tiny layers are narrower than 32
    rows, results = [], {}
    for family, modules in parts.items():
        counts = {part: sum(p.numel() for p in m.parameters()) for part, m in modules.items()}
        for part, count in counts.items():
            card = CARD_BILLIONS.get(part)
            if card is not None and not args.tiny:  # the config written out here is the release's
                assert abs(count / 1e9 - card) <= 0.02 * card, f"{part}: {count / 1e9:.2f}B, its card {card}B"
        transformer, known = next(iter(counts)), family_of(family)
        adapters, float8 = lora_counts(family, modules[transformer], rank)
        gib = {str(n): per_gpu(counts, adapters, n, known.loading.texts_first, float8) for n in (1, 8)}
        pipefusion = "pipefusion" in known.capabilities.parallel
        runs = [r for r in gib["1"] if r != "sample-pipefusion" or pipefusion]  # what the family runs
        gib = {n: {r: gib[n][r] for r in runs} for n in gib}
        results[family] = dict(parameters=counts, adapters=adapters, gib_per_gpu=gib)
        parts_text = ", ".join(f"{part} {count / 1e9:.2f}B" for part, count in counts.items())
        labels = {
            "sample": "sampling",
            "sample-pipefusion": "sampling, PipeFusion over the GPUs",
            "sample-float8": "sampling, model.base_dtype=float8",
            "full": "full fine-tuning",
            "lora": f"LoRA rank {rank}",
            "lora-latents": f"LoRA rank {rank}, data.latents",
            "lora-float8-latents": f"LoRA rank {rank}, data.latents, model.base_dtype=float8",
        }
        for recipe, label in ((r, labels[r]) for r in runs):
            figures = [f"{gib[n][recipe]:.1f} GiB" for n in ("1", "8")]
            rows.append([family, label, parts_text if recipe == "sample" else "", *figures])
    print(benchlib.table(["family", "recipe", "parameters (counted)", "per GPU, 1 GPU", "8 GPUs"], rows))
    if args.json:
        benchlib.write_json(args.json, dict(tiny=args.tiny, lora_rank=rank, families=results))


if __name__ == "__main__":
    main()
