"""tessera's DiT's recipe keys (models/recipe_keys.py): its dimensions and the Wan options, image-to-video's
image features, and Wan 2.2 A14B's two experts."""

from typing import Optional

from models.recipe_keys import RecipeKey

DIT = ("dit",)
KEYS = (
    # The size's depth, width and heads, replaced where set (model.size=auto sets them for a folder whose
    # dimensions no named size has: a pruned, distilled or community variant); null: the size's
    RecipeKey("model.depth", Optional[int], None, DIT, at_least=1, null="the size's"),
    RecipeKey("model.hidden_size", Optional[int], None, DIT, at_least=1, null="the size's"),
    RecipeKey("model.num_heads", Optional[int], None, DIT, at_least=1, null="the size's"),
    RecipeKey("model.patch_size", list[int], [1, 2, 2], DIT),  # (time, height, width)
    RecipeKey("model.mlp_ratio", float, 4.0, DIT),
    RecipeKey("model.qk_norm", bool, True, DIT),
    RecipeKey("model.rope_theta", float, 10000.0, DIT),
    # Architecture options; None takes the size's choice (the Wan* sizes set the Wan ones), else the
    # tessera default shown after the colon.
    RecipeKey("model.ffn_dim", Optional[int], None, DIT),  # MLP width: hidden_size x mlp_ratio
    # zero (a Linear(D, 6D) per block) | single (shared projection + per-block table): zero
    RecipeKey("model.adaln", Optional[str], None, DIT),
    # QK RMSNorm over all heads at once (Wan): false
    RecipeKey("model.qk_norm_across_heads", Optional[bool], None, DIT),
    # the mean text token joins the time embedding: true
    RecipeKey("model.pooled_text", Optional[bool], None, DIT),
    # mask padded text tokens (false: zero them and attend, as Wan): true
    RecipeKey("model.text_mask", Optional[bool], None, DIT),
    # add fixed sin-cos absolute positions to the tokens (the original DiT's), besides RoPE: false
    RecipeKey("model.absolute_positions", Optional[bool], None, DIT),
    # image-to-video: the width of the CLIP image features (Wan2.1 I2V/FLF2V: 1280; Wan2.2 I2V: none)
    RecipeKey("model.image_dim", Optional[int], None, DIT),
    RecipeKey("model.image_tokens", Optional[int], None, DIT),  # CLIP tokens per image (ViT-H/14: 257): 257
    RecipeKey("model.image_positions", Optional[bool], None, DIT),  # FLF2V's learnt position embedding
    # Wan 2.2 A14B: the low-noise expert's folder (a WanTransformer3DModel); None: model.pretrained's
    # transformer_2/ when it is a pipeline folder with one (sampling only)
    RecipeKey("model.pretrained_2", Optional[str], None, DIT),
    # Wan 2.2 A14B expert training: none | high (trains on noise levels >= sample.boundary, from
    # model.pretrained) | low (below it, from model.pretrained_2 or model.pretrained's transformer_2/)
    RecipeKey("model.expert", str, "none", DIT, choices=("none", "high", "low")),
    # Wan 2.2 A14B's two experts (docs/internals.md): the low-noise expert samples below `boundary` (a
    # fraction of the noise, as diffusers' boundary_ratio; None: model.pretrained's model_index.json), at
    # `guidance_2` (None: sample.guidance)
    RecipeKey("sample.guidance_2", Optional[float], None, DIT),
    RecipeKey("sample.boundary", Optional[float], None, DIT),
)
