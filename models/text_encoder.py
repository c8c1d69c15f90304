"""Frozen text encoders: prompts -> (embeddings (B, L, D), mask (B, L) bool), cached per prompt.

T5 / UMT5 / CLIP load from a local folder with transformers' `from_pretrained`; with no folder,
a tiny random T5 with the ByT5 tokenizer (bytes, so no vocabulary file) stands in for the demo and
tests. Prompts repeat a lot in training (captions, the empty prompt for guidance), so each prompt is
encoded once and kept in a small LRU cache.
"""

import html
import json
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn as nn

from models.util import seeded

try:  # diffusers' Wan pipelines fix the prompt's text with ftfy where it is installed: so does wan_prompt
    import ftfy
except ImportError:
    ftfy = None


def wan_prompt(prompt: str) -> str:
    """A prompt as Wan's pipelines clean it before UMT5 (diffusers' prompt_clean): ftfy's fix where it is
    installed, as there; HTML entities undone twice; each run of whitespace one space, stripped. Without
    it a prompt with a doubled or trailing space is cut to other tokens than Wan's."""
    prompt = ftfy.fix_text(prompt) if ftfy is not None else prompt
    # \s as the `regex` module diffusers uses reads it (Python's re also takes \x1c-\x1f for spaces)
    return re.sub(r"[^\S\x1c-\x1f]+", " ", html.unescape(html.unescape(prompt))).strip()


class TextEncoder(nn.Module):
    def __init__(self, tokenizer, model: nn.Module, max_length: int, cache_size: int = 4096, clean=None):
        super().__init__()
        self.clean = clean  # the prompt as the model's pipeline cleans it (wan_prompt), or None
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        self.max_length = max_length
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @property
    def dim(self) -> int:
        cfg = self.model.config
        return getattr(cfg, "d_model", None) or cfg.hidden_size

    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str]):
        prompts = [self.clean(p) for p in prompts] if self.clean else prompts
        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        device = next(self.model.parameters()).device
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return hidden.float().cpu(), mask.bool().cpu()

    def forward(self, prompts: list[str], device=None):
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if missing:
            emb, mask = self._encode_uncached(missing)
            for i, prompt in enumerate(missing):
                self._cache[prompt] = (emb[i], mask[i])
        for p in prompts:
            self._cache.move_to_end(p)
        emb = torch.stack([self._cache[p][0] for p in prompts])
        mask = torch.stack([self._cache[p][1] for p in prompts])
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return emb.to(device), mask.to(device)


def tiny_t5(d_model: int = 32, num_layers: int = 2):
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=384,
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=num_layers,
        num_heads=4,
        dropout_rate=0.0,
    )
    return ByT5Tokenizer(), T5EncoderModel(config)


def load_pretrained_text_encoder(kind: str, path: str):
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"text_encoder.pretrained='{path}' is not a local folder; tessera never downloads "
            f"weights: save the encoder and tokenizer with save_pretrained() and point to that folder"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if kind == "t5":
        from transformers import T5EncoderModel as cls
    elif kind == "umt5":
        from transformers import UMT5EncoderModel as cls
    else:
        from transformers import CLIPTextModel as cls
    tokenizer_dir = folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder
    model_dir = (
        folder / "text_encoder" if (folder / "text_encoder").is_dir() else folder
    )  # a pipeline folder works too
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"text_encoder.pretrained='{path}' has no config.json; save the encoder with "
            f"save_pretrained() into that folder (and its tokenizer beside it or in tokenizer/)"
        )
    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True), cls.from_pretrained(
        model_dir, local_files_only=True
    )


def text_encoder_dim(text_cfg) -> int:
    """The width of the text embeddings the recipe's encoder gives (TextEncoder.dim), from its config.json
    alone: a meta-device DiT can be built to check a recipe before any weight is loaded."""
    if not text_cfg.pretrained:
        return text_cfg.tiny_d_model
    folder = Path(text_cfg.pretrained)
    config = folder / "text_encoder" / "config.json"
    config = config if config.is_file() else folder / "config.json"
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"text_encoder.pretrained='{text_cfg.pretrained}': cannot read {config} ({e}); save the encoder "
            "with save_pretrained() into that folder"
        ) from None
    values = values.get("text_config", values)  # a whole CLIPModel's config keeps the text tower's apart
    width = values.get("d_model") or values.get("hidden_size")
    if not width:
        raise ValueError(f"text_encoder.pretrained: {config} names no d_model or hidden_size")
    return width


def build_text_encoder(text_cfg) -> TextEncoder:
    if text_cfg.pretrained:
        tokenizer, model = load_pretrained_text_encoder(text_cfg.kind, text_cfg.pretrained)
    else:
        if text_cfg.kind != "t5":
            raise ValueError(
                f"text_encoder.kind={text_cfg.kind} needs text_encoder.pretrained (a local folder); "
                f"only the tiny random t5 can be built without one"
            )
        with seeded(text_cfg.seed):
            tokenizer, model = tiny_t5(text_cfg.tiny_d_model, text_cfg.tiny_layers)
    clean = wan_prompt if text_cfg.kind == "umt5" else None  # UMT5 is Wan's encoder
    return TextEncoder(tokenizer, model, text_cfg.max_length, text_cfg.cache_size, clean)
