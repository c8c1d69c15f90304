"""Small helpers shared by the model code."""

import contextlib

import torch


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block under a fixed seed without touching the caller's random state, so that a tiny
    random model is the same in every process that builds it (training, sampling, every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
