"""FLUX.2's text encoding. klein's, as diffusers' Flux2KleinPipeline._get_qwen3_prompt_embeds: each prompt in
the tokenizer's chat template (a user turn, the generation prompt, thinking disabled), padded on the right to
max_sequence_length, Qwen3's hidden states of layers 9, 18 and 27 side by side per token. dev's, as
Flux2Pipeline._get_mistral_3_small_prompt_embeds: BFL's system message and the prompt as turns of the
processor's chat template, padded on the tokenizer's side (Mistral's: the left), Mistral 3's layers 10, 20
and 30. Every position kept (the transformer sees the padding unmasked, as the pipelines give it)."""

import torch

MAX_SEQUENCE_LENGTH = 512
LAYERS = (9, 18, 27)
DEV_LAYERS = (10, 20, 30)


def stacked(hidden_states, layers) -> torch.Tensor:
    """The hidden states of `layers`, (B, L, H) each, side by side per token: (B, L, len(layers) H)."""
    out = torch.stack([hidden_states[k] for k in layers], dim=1)  # (B, n, L, H)
    B, n, L, H = out.shape
    return out.permute(0, 2, 1, 3).reshape(B, L, n * H)


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
    return stacked(out.hidden_states, LAYERS)


@torch.no_grad()
def encode_prompt_dev(prompts, processor, text_encoder, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """dev's: prompts (a str or a list) -> (B, max_sequence_length, 3 x hidden) in the encoder's dtype."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    turn = lambda role, text: {"role": role, "content": [{"type": "text", "text": text}]}  # noqa: E731
    # the pipeline drops "[IMG]" from prompts: the processor would count it as an image's place
    messages = [[turn("system", SYSTEM_MESSAGE), turn("user", p.replace("[IMG]", ""))] for p in prompts]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
        padding="max_length", truncation=True, max_length=max_sequence_length,
    )  # fmt: skip
    device = next(text_encoder.parameters()).device
    ids, masks = inputs["input_ids"].to(device), inputs["attention_mask"].to(device)
    out = text_encoder(input_ids=ids, attention_mask=masks, output_hidden_states=True, use_cache=False)
    return stacked(out.hidden_states, DEV_LAYERS)
