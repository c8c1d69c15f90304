"""Single-device model code: the DiT, attention operators, VAE and text-encoder wrappers, and the
rectified-flow objective. Nothing here knows about processes or collectives; parallel/ applies them."""
