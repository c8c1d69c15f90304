"""Single-device model code: the DiT, attention operators, VAE and text-encoder wrappers, and the
rectified-flow objective. Single-device code: nothing here knows about processes or collectives."""
