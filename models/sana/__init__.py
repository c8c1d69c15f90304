"""The Sana family (NVlabs; diffusers' SanaPipeline): its transformer, weight names, prompt encoding and
sampling pieces, each tested against diffusers in tests/test_sana.py. Single-device code."""

from models.sana.sampling import (
    DCAE_SCALING_FACTOR,
    RELEASE_SCHEDULER,
    SanaSchedule,
    classifier_free_guidance,
    denormalize_latents,
    dpm_solver_step,
    flow_schedule,
    latent_shape,
    normalize_latents,
)
from models.sana.text import COMPLEX_HUMAN_INSTRUCTION, MAX_SEQUENCE_LENGTH, encode_text
from models.sana.transformer import SanaConditioning, SanaTransformer
from models.sana.weights import (
    ORIGINAL_ONLY,
    SanaFormatError,
    build_sana,
    diffusers_from_original,
    diffusers_from_tessera,
    original_from_diffusers,
    sana_kwargs_from_diffusers_config,
    tessera_from_diffusers,
)

__all__ = [
    "COMPLEX_HUMAN_INSTRUCTION",
    "DCAE_SCALING_FACTOR",
    "MAX_SEQUENCE_LENGTH",
    "ORIGINAL_ONLY",
    "RELEASE_SCHEDULER",
    "SanaConditioning",
    "SanaFormatError",
    "SanaSchedule",
    "SanaTransformer",
    "build_sana",
    "classifier_free_guidance",
    "denormalize_latents",
    "diffusers_from_original",
    "diffusers_from_tessera",
    "dpm_solver_step",
    "encode_text",
    "flow_schedule",
    "latent_shape",
    "normalize_latents",
    "original_from_diffusers",
    "sana_kwargs_from_diffusers_config",
    "tessera_from_diffusers",
]
