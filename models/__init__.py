"""Single-device model code: the DiT, attention operators, VAE and text-encoder wrappers, and the
rectified-flow objective. Nothing in this package imports torch.distributed."""
