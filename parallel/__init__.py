"""Everything that spans processes, in five parts (the layers above import their modules by full path):

compute/      collectives, layout, Ulysses / Ring / CFG / PipeFusion, FSDP2, FP8, shared VAE tiles
lifecycle/    entry point, rendezvous, runtime, watchdog, faults, exits, memory plan, storage, finite
checkpoints/  save and load, the folder on disk, safe reading, what a checkpoint records
build/        the components a recipe names, weights into a sharded model, LoRA on it
drive/        a family's training step and its sampling across the layout (train.py, infer.py)
"""
