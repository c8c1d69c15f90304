"""HunyuanVideo 1.5's two text encodings, as diffusers' HunyuanVideo15Pipeline.encode_prompt gives them:
Qwen2.5-VL's third-to-last hidden state of the prompt in the pipeline's chat template (its first 108
tokens dropped), and ByT5's last hidden state of the prompt's quoted texts (the glyphs to draw). The
pipeline pads both to fixed lengths (1,000 and 256); here each is padded to the batch's longest prompt
only, which the transformer's masks make the same (padded tokens are zeroed and never attended).
"""

import re

import torch

from models.family import padded

# the pipeline's string carries its source's line continuations: nine spaces before each item
SYSTEM_MESSAGE = "You are a helpful assistant. Describe the video by detailing the following aspects:"
SYSTEM_MESSAGE += "".join(
    " " * 9 + item
    for item in (
        "1. The main content and theme of the video.",
        "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.",
        "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.",
        "4. background environment, light, style and atmosphere.",
        "5. camera angles, movements, and transitions used in the video.",
    )
)
CROP_START = 108  # the template's tokens dropped from the hidden states (the pipeline's, for any tokenizer)
MAX_LENGTH = 1000  # the pipeline's text length after the crop (text_encoder.max_length)
GLYPH_MAX_LENGTH = 256
SKIP_LAYERS = 2  # hidden_states[-(2 + 1)]


def glyph_text(prompt: str) -> str | None:
    """The texts quoted in `prompt` ("..." or “...”), each once, as `Text "a". Text "b". `; None if none
    (the pipeline's extract_glyph_texts)."""
    found = [a or b for a, b in re.findall(r"\"(.*?)\"|“(.*?)”", prompt)]
    found = list(dict.fromkeys(found)) if len(found) > 1 else found
    return ". ".join(f'Text "{text}"' for text in found) + ". " if found else None


def _trimmed(hidden, mask) -> tuple:
    """Hidden states (B, L, D) and mask (B, L) cut to the longest real length (the padding is on the
    right), padded positions zeroed; the mask None when nothing is padded (one sampling's host sync, so
    that attention runs without a mask, as on one prompt)."""
    length = int(mask.sum(dim=1).max())
    hidden, mask = hidden[:, :length], mask[:, :length].bool()
    return hidden * mask[..., None].to(hidden.dtype), (None if bool(mask.all()) else mask)


@torch.no_grad()
def encode_text(prompts: list, tokenizer, text_encoder, max_length: int = MAX_LENGTH) -> tuple:
    """(embeddings (B, L, D) in the encoder's dtype, mask (B, L) bool or None) of Qwen2.5-VL for prompts."""
    if tokenizer.padding_side != "right":  # the template's crop and the trim count from the left
        raise ValueError(
            f"{type(tokenizer).__name__} pads on the {tokenizer.padding_side}: HunyuanVideo 1.5's prompt "
            "encoding crops the template's first tokens; set padding_side right in the folder's "
            "tokenizer_config.json"
        )
    turn = lambda p: [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": p or " "}]  # noqa: E731
    chats = [turn(p) for p in prompts]
    tokens = tokenizer.apply_chat_template(
        chats,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        padding=True,
        max_length=max_length + CROP_START,
        truncation=True,
        return_tensors="pt",
    )
    device = next(text_encoder.parameters()).device
    ids, attention = tokens["input_ids"].to(device), tokens["attention_mask"].to(device)
    out = text_encoder(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    return _trimmed(out.hidden_states[-(SKIP_LAYERS + 1)][:, CROP_START:], attention[:, CROP_START:])


@torch.no_grad()
def encode_glyphs(prompts: list, tokenizer, text_encoder, dtype) -> tuple:
    """(embeddings (B, L2, D) in `dtype`, mask (B, L2) bool, None when nothing is padded) of ByT5 for the
    prompts' quoted texts; a prompt without one has none (L2 is 0 when no prompt has one)."""
    device = next(text_encoder.parameters()).device
    encoded = []
    for text in map(glyph_text, prompts):
        if text is None:
            encoded.append(torch.zeros(0, text_encoder.config.d_model, device=device, dtype=dtype))
            continue
        tokens = tokenizer(text, max_length=GLYPH_MAX_LENGTH, truncation=True, return_tensors="pt").to(device)
        hidden = text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.float())[0]
        encoded.append(hidden[0].to(dtype))
    glyphs, mask = padded(encoded)
    return glyphs, None if mask is None else mask.to(device)
