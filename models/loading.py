"""How a family's parts load (Family.loading), declared in one object that the code above models/ reads
instead of a family's name: where its text encoder and VAE come from, the order its parts load in, and the
weights' dtype and the VAE's tiles at sampling."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Loading:
    # its text encoder and VAE are model.pretrained's folder's (read on every start); else their own keys
    # (text_encoder.pretrained, vae.pretrained: tessera's DiT)
    from_pretrained: bool = True
    # sampling encodes every prompt, then frees its text encoder before the transformer loads (FLUX.2 dev's
    # 24B Mistral beside its 32B transformer: one 80 GB GPU holds either, not both): Family.encode_first
    texts_first: bool = False
    # its sampling keeps float32 weights and computes under autocast (else: weights in the compute dtype)
    float32_weights: bool = False
    # its VAE decodes in tessera's tiles, which a replica's ranks share (parallel/compute/vae.py)
    tiled_vae: bool = False
