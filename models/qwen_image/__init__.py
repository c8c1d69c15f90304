"""The Qwen-Image family (text-to-image MMDiT; diffusers' QwenImagePipeline): transformer.py the model,
text.py the prompt encoding, sampling.py noise, schedule, guidance and latent normalisation, weights.py
config reading and key maps. Each piece is tested against diffusers in
tests/test_qwen_image.py. Its names load on first use (PEP 562): keys.py, read by the schema, imports
the package alone.
"""

import importlib

_HOME = {
    "sampling": ("calculate_shift", "denormalize_latents", "image_tokens", "initial_noise",
                 "normalize_latents", "sigmas", "true_cfg"),
    "text": ("encode_prompt",),
    "transformer": ("JointAttention", "QwenImageCond", "QwenImageContext", "QwenImageTransformer",
                    "pack_latents", "unpack_latents"),
    "weights": ("QwenImageFormatError", "build_transformer", "diffusers_config_from_kwargs",
                "diffusers_state_dict_from_original", "diffusers_state_dict_from_tessera",
                "original_state_dict_from_diffusers", "tessera_state_dict_from_diffusers",
                "transformer_kwargs_from_diffusers_config"),
}  # fmt: skip
__all__ = sorted(name for names in _HOME.values() for name in names)
_MODULE = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)
    return value


def __dir__() -> list:
    return sorted([*globals(), *__all__])
