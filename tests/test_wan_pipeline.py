"""infer.py against diffusers' WanPipeline, code no one here wrote: the same tiny random pipeline folder
(transformer, AutoencoderKLWan, UMT5 with the ByT5 tokenizer, FlowMatchEulerDiscreteScheduler with
shift 3), the same prompt, negative prompt, seed, steps and guidance give the same video. This holds
tessera's noise draw, Wan's fixed shift, the trimmed and zero-padded text, the guidance and the VAE's
latent normalisation to diffusers'."""

import numpy as np
import torch

import infer
from tests.conftest import run_main

RECIPE = """
model:
  size: DiT-tiny          # 2 layers, 64 wide, 4 heads: the pipeline's transformer below
  patch_size: [1, 2, 2]
  adaln: single
  qk_norm_across_heads: true
  pooled_text: false
  text_mask: false
  ffn_dim: 32
  pretrained: {pipe}
vae:
  kind: wan
  pretrained: {pipe}
text_encoder:
  kind: umt5
  pretrained: {pipe}
  max_length: 40
flow:
  shift: 3.0
  shift_reference_tokens: 0   # Wan's fixed shift
sample:
  steps: 3
  guidance: 5.0
logging:
  wandb: false
"""


def test_infer_equals_wan_pipeline(tmp_path):
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32)
    with torch.no_grad():  # zero-initialised layers would make the output constant
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                           latents_std=[1.5, 0.8, 1.2, 1.0])
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=384, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4,
                                               relative_attention_num_buckets=8))
    pipe_dir = tmp_path / "pipe"
    WanPipeline(tokenizer=ByT5Tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0)).save_pretrained(pipe_dir)

    prompt = "a red square moving left"
    expected = WanPipeline.from_pretrained(pipe_dir)(
        prompt, negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=3, guidance_scale=5.0,
        generator=torch.Generator().manual_seed(0), output_type="np", max_sequence_length=40).frames[0]

    recipe = tmp_path / "wan.yaml"
    recipe.write_text(RECIPE.format(pipe=pipe_dir))
    out = tmp_path / "tessera.npy"
    assert run_main(infer, ["--config", str(recipe), f"run.output_dir={tmp_path / 'run'}", "--frames", "5",
                            "--height", "32", "--width", "32", "--prompt", prompt, "--output", str(out)]) == 0
    video = np.load(out)
    assert video.shape == expected.shape == (5, 32, 32, 3)
    assert expected.std() > 0.05  # not a flat video that anything would match
    assert np.abs(video - expected).max() <= 1e-4  # measured 2.4e-7; the bound is 1e-3
