"""Distributing the compute: collectives (comm), the layout, sequence parallelism (Ulysses, Ring, the
operators by kind), CFG and PipeFusion sampling, the VAE's shared tiles, FSDP2 and FP8, the step cache
across ranks."""
