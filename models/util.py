"""Small helpers shared by the model code."""

import contextlib
import pickle

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
    """Load `what` (the frozen parts: text encoder, VAE, image encoder) inside this block: a weights file the
    libraries refuse to unpickle (a .bin pickle that torch.load(weights_only=True) will not read) becomes one
    `error:` line naming it, not a traceback. Every other error passes as it is."""
    try:
        yield
    except pickle.UnpicklingError as e:
        raise WeightsUnreadable(_unreadable(what, e)) from None
    except (OSError, RuntimeError) as e:  # the libraries wrap torch.load's refusal in these
        if isinstance(e, FileNotFoundError) or not _refused_pickle(e):
            raise
        raise WeightsUnreadable(_unreadable(what, e)) from None


def _refused_pickle(error: BaseException) -> bool:
    """Whether `error` is torch.load(weights_only=True) refusing a pickle: its own words, or diffusers'
    "Unable to load weights from checkpoint file" about a .bin or .pth file (diffusers says the same of a
    damaged .safetensors, which is no pickle)."""
    text = str(error)
    if "weights_only" in text or "Weights only load failed" in text:
        return True
    if isinstance(error.__cause__ or error.__context__, pickle.UnpicklingError):
        return True
    return "Unable to load weights from checkpoint" in text and any(
        k in text for k in (".bin'", ".pth'", ".pt'")
    )


def _unreadable(what: str, error: BaseException) -> str:
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return (
        f"{what}: its weights could not be read ({type(error).__name__}: {first[:300]}). tessera reads "
        ".safetensors weights, and .bin pickles only as far as torch.load(weights_only=True) takes them (a "
        "file that names code is refused, and nothing in it runs): use the release's .safetensors files, or "
        "convert these with a tool you trust"
    )
