"""LTX-2's prompt encoding, as diffusers' LTX2Pipeline.encode_prompt and its connectors give it: the prompt
stripped, left-padded to max_sequence_length (Gemma's positions count the padding, so the text is not cut
to the batch's longest), every hidden state of the text encoder stacked per token, then the connectors
(diffusers' LTX2TextConnectors) give the video text, the audio text and their 0/1 mask.
"""

import torch

from models.ltx2.transformer import LTX2Cond


def prepare_tokenizer(tokenizer):
    """The tokenizer as the pipeline sets it before encoding: left padding, its eos as the pad token when
    it has none."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@torch.no_grad()
def encode_prompts(
    prompts: list, tokenizer, text_encoder, connectors, max_length: int, fps: float
) -> LTX2Cond:
    """LTX2Cond of `prompts`: both streams' texts (B, max_length', D) in the encoder's dtype and the
    connectors' mask (B, max_length') int64, shared by both streams, at the conditioning frame rate `fps`."""
    tokens = tokenizer(
        [p.strip() for p in prompts],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    device = next(text_encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    out = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(text_encoder.dtype)
    text, audio_text, text_mask = connectors(hidden, mask, padding_side=tokenizer.padding_side)
    return LTX2Cond(text, audio_text, text_mask, text_mask, fps=fps)
