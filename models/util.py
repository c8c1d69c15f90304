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


class WeightsUnreadable(ValueError):
    """A frozen part's weights that its library would not read (a user error: the message says what to do)."""


@contextlib.contextmanager
def reading_weights(what: str):
    """Load `what` (the frozen parts: text encoder, VAE, image encoder) inside this block: what the libraries
    refuse (a .bin pickle that torch.load(weights_only=True) will not unpickle, a file they cannot open)
    becomes one `error:` line naming it, not a traceback. A missing folder stays a FileNotFoundError."""
    import pickle

    try:
        yield
    except FileNotFoundError:
        raise
    except (OSError, pickle.UnpicklingError) as e:
        raise WeightsUnreadable(_unreadable(what, e)) from None
    except RuntimeError as e:
        if "weights_only" not in str(e) and "Weights only load failed" not in str(e):
            raise
        raise WeightsUnreadable(_unreadable(what, e)) from None


def _unreadable(what: str, error: BaseException) -> str:
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return (
        f"{what}: its weights could not be read ({type(error).__name__}: {first[:300]}). tessera reads "
        ".safetensors weights, and .bin pickles only as far as torch.load(weights_only=True) takes them (a "
        "file that names code is refused, and nothing in it runs): use the release's .safetensors files, or "
        "convert these with a tool you trust"
    )
