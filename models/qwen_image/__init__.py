"""The Qwen-Image family (text-to-image MMDiT; diffusers' QwenImagePipeline): transformer.py the model,
text.py the prompt encoding, sampling.py noise, schedule, guidance and latent normalisation, weights.py
folder detection, config reading and key maps. Each piece is tested against diffusers in
tests/test_qwen_image.py.
"""

from models.qwen_image.sampling import (
    calculate_shift,
    denormalize_latents,
    image_tokens,
    initial_noise,
    normalize_latents,
    sigmas,
    true_cfg,
)
from models.qwen_image.text import encode_prompt
from models.qwen_image.transformer import (
    JointAttention,
    QwenImageCond,
    QwenImageContext,
    QwenImageTransformer,
    pack_latents,
    unpack_latents,
)
from models.qwen_image.weights import (
    QwenImageFormatError,
    build_transformer,
    diffusers_config_from_kwargs,
    diffusers_state_dict_from_original,
    diffusers_state_dict_from_tessera,
    is_qwen_image,
    original_state_dict_from_diffusers,
    tessera_state_dict_from_diffusers,
    transformer_kwargs_from_diffusers_config,
)

__all__ = [
    "JointAttention",
    "QwenImageCond",
    "QwenImageContext",
    "QwenImageFormatError",
    "QwenImageTransformer",
    "build_transformer",
    "calculate_shift",
    "denormalize_latents",
    "diffusers_config_from_kwargs",
    "diffusers_state_dict_from_original",
    "diffusers_state_dict_from_tessera",
    "encode_prompt",
    "image_tokens",
    "initial_noise",
    "is_qwen_image",
    "normalize_latents",
    "original_state_dict_from_diffusers",
    "pack_latents",
    "sigmas",
    "tessera_state_dict_from_diffusers",
    "transformer_kwargs_from_diffusers_config",
    "true_cfg",
    "unpack_latents",
]
