"""Qwen-Image's text encoding: Qwen2.5-VL's last hidden state of the prompt in the pipeline's chat
template, the template's first 34 tokens dropped, padded per batch to the longest prompt (no fixed
length), exactly as diffusers' QwenImagePipeline.encode_prompt gives it.
"""

import torch

from models.family import padded

# The pipeline's template; its first DROP_TOKENS tokens (the system turn, with Qwen's own tokenizer) are
# dropped from the hidden states, whatever tokenizer is used (diffusers does the same).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP_TOKENS = 34
TOKENIZER_MAX_LENGTH = 1024  # the pipeline's; tokens beyond it (after the dropped ones) are cut
MAX_SEQUENCE_LENGTH = 512  # the pipeline's default max_sequence_length (it accepts at most 1024)


@torch.no_grad()
def encode_prompt(prompts, tokenizer, text_encoder, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """prompts (a str or a list) -> (embeddings (B, L, D) in the encoder's dtype, mask (B, L) bool or
    None). L is the longest prompt's token count after the drop, at most max_sequence_length; shorter
    prompts are zero-padded and masked. The mask is None when every token is real, as the pipeline's
    (the transformer then attends without a mask)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    tokens = tokenizer(
        [PROMPT_TEMPLATE.format(p) for p in prompts],
        max_length=TOKENIZER_MAX_LENGTH + DROP_TOKENS,
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    device = next(text_encoder.parameters()).device
    ids, attention = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    hidden = text_encoder(input_ids=ids, attention_mask=attention, output_hidden_states=True).hidden_states[
        -1
    ]
    # each prompt's real tokens, wherever the tokenizer put the padding, less the template's head
    kept = [h[m.bool()][DROP_TOKENS:][:max_sequence_length] for h, m in zip(hidden, attention)]
    embeddings, mask = padded(kept)
    return embeddings, None if mask is None else mask.to(device)


# Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline): the template with the pictures before the
# instruction; its first EDIT_DROP_TOKENS tokens dropped; no cut at a maximum length (the pipeline's)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_DROP_TOKENS = 64
IMAGE_PAD = "<|image_pad|>"
PICTURE = "Picture {}: <|vision_start|>" + IMAGE_PAD + "<|vision_end|>"


def vision_inputs(text: str, images: list, image_processor, tokenizer) -> dict:
    """What Qwen2VLProcessor gives for one text with `images`: the images' patches and grids, and the
    text tokenised with each <|image_pad|> repeated once per merged patch of its image. Written out here:
    transformers' processor class also wants a video processor, which needs torchvision."""
    vision = image_processor(images=images, return_tensors="pt")
    merged = (vision["image_grid_thw"].prod(-1) // image_processor.merge_size**2).tolist()
    head, *rest = text.split(IMAGE_PAD)
    text = head + "".join(IMAGE_PAD * n + tail for n, tail in zip(merged, rest, strict=True))
    return dict(tokenizer([text], return_tensors="pt"), **vision)


@torch.no_grad()
def encode_edit_prompt(prompts, images: list, image_processor, tokenizer, text_encoder):
    """prompts with the reference `images` (PIL, already sized for the text encoder) -> (embeddings
    (B, L, D), mask (B, L) bool or None), as QwenImageEditPlusPipeline encodes one prompt: "Picture i:" and
    each image's vision tokens before the instruction, Qwen2.5-VL's last hidden state of the real tokens,
    the template's head dropped. One prompt at a time (the pipeline's batch), padded to the longest."""
    pictures = "".join(PICTURE.format(i + 1) for i in range(len(images)))
    device = next(text_encoder.parameters()).device
    kept = []
    for prompt in [prompts] if isinstance(prompts, str) else prompts:
        text = EDIT_TEMPLATE.format(pictures + prompt)
        inputs = {k: v.to(device) for k, v in vision_inputs(text, images, image_processor, tokenizer).items()}
        hidden = text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        ).hidden_states[-1]
        kept.append(hidden[0][inputs["attention_mask"][0].bool()][EDIT_DROP_TOKENS:])
    embeddings, mask = padded(kept)
    return embeddings, None if mask is None else mask.to(device)
