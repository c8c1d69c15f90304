"""FLUX.2 klein's text encoding, as diffusers' Flux2KleinPipeline._get_qwen3_prompt_embeds: each prompt in the
tokenizer's chat template (a user turn, the generation prompt, thinking disabled), padded on the right to
max_sequence_length, Qwen3's hidden states of layers 9, 18 and 27 side by side per token; every position
kept (the transformer sees the padding unmasked, as the pipeline gives it)."""

import torch

MAX_SEQUENCE_LENGTH = 512
LAYERS = (9, 18, 27)


@torch.no_grad()
def encode_prompt(prompts, tokenizer, text_encoder, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """prompts (a str or a list) -> (B, max_sequence_length, 3 x hidden) in the encoder's dtype."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids, masks = [], []
    for prompt in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        tokens = tokenizer(
            text, return_tensors="pt", padding="max_length", truncation=True, max_length=max_sequence_length
        )
        ids.append(tokens["input_ids"])
        masks.append(tokens["attention_mask"])
    device = next(text_encoder.parameters()).device
    ids, masks = torch.cat(ids).to(device), torch.cat(masks).to(device)
    out = text_encoder(input_ids=ids, attention_mask=masks, output_hidden_states=True, use_cache=False)
    stacked = torch.stack([out.hidden_states[k] for k in LAYERS], dim=1)  # (B, 3, L, H)
    B, n, L, H = stacked.shape
    return stacked.permute(0, 2, 1, 3).reshape(B, L, n * H)
