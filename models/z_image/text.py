"""Z-Image's text encoding, as diffusers' ZImagePipeline._encode_prompt: each prompt in the tokenizer's chat
template (a user turn, the generation prompt, thinking enabled), padded to max_sequence_length, Qwen3's
second-to-last hidden state, each prompt's real tokens kept; here zero-padded to the batch's longest with a
mask (None when every prompt has as many tokens), which the transformer turns back into the list.
"""

import torch

from models.family import padded

MAX_SEQUENCE_LENGTH = 512  # the pipeline's default


@torch.no_grad()
def encode_prompt(prompts, tokenizer, text_encoder, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """prompts (a str or a list) -> (embeddings (B, L, D) in the encoder's dtype, mask (B, L) bool or
    None)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        for p in prompts
    ]
    tokens = tokenizer(
        chats, padding="max_length", max_length=max_sequence_length, truncation=True, return_tensors="pt"
    )
    device = next(text_encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device).bool()
    hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    embeddings, real = padded([h[m] for h, m in zip(hidden, mask)])
    return embeddings, None if real is None else real.to(device)
