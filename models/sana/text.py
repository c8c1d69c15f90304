"""Sana's prompt encoding, as diffusers' SanaPipeline.encode_prompt gives it; single-device code.

Gemma-2-2B-it's last hidden state (after its final norm) of the lowercased, stripped prompt, right-padded.
A prompt gets the release's complex human instruction (CHI) prepended and is tokenised to the CHI's length
plus max_sequence_length - 2; of those the first token (<bos>) and the last max_sequence_length - 1 are
kept, which drops the CHI but for its end. The negative prompt gets no CHI (instruction=None): its
max_sequence_length tokens are kept whole.
"""

import torch

# SanaPipeline's default `complex_human_instruction`. NVlabs' configs quote "Enhanced prompt" with double
# quotes; diffusers' (what its hub pipelines run, tested here) with single ones.
COMPLEX_HUMAN_INSTRUCTION = [
    "Given a user prompt, generate an 'Enhanced prompt' that provides detailed visual descriptions suitable "
    "for image generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without "
    "overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, "
    "sleeping peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing "
    "street lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by "
    "towering glass skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
]
MAX_SEQUENCE_LENGTH = 300  # the release's


@torch.no_grad()
def encode_text(
    tokenizer,
    text_encoder,
    prompts,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
    instruction=COMPLEX_HUMAN_INSTRUCTION,
):
    """prompts (a list of str) -> (embeddings (B, max_sequence_length, width; 2304 for Gemma-2-2B) in the
    encoder's dtype, mask (B, max_sequence_length) int64, 1 for a real token). instruction=None for the
    negative prompt."""
    prompts = [p.lower().strip() for p in prompts]  # what the pipeline does without clean_caption
    length = max_sequence_length
    if instruction:
        chi = "\n".join(instruction)
        prompts = [chi + p for p in prompts]
        length = len(tokenizer.encode(chi)) + max_sequence_length - 2
    tokens = tokenizer(
        prompts,
        padding="max_length",
        max_length=length,
        truncation=True,
        add_special_tokens=True,
        padding_side="right",
        return_tensors="pt",
    )
    device = next(text_encoder.parameters()).device
    mask = tokens.attention_mask.to(device)
    hidden = text_encoder(tokens.input_ids.to(device), attention_mask=mask)[0].to(text_encoder.dtype)
    keep = [0, *range(length - max_sequence_length + 1, length)]  # <bos>, then the last L - 1 tokens
    return hidden[:, keep], mask[:, keep]
