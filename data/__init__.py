"""Datasets (a JSONL manifest of images/videos, the synthetic demo generator), the distributed
sampler and the loader."""
