"""The Z-Image family (Tongyi-MAI; diffusers' ZImagePipeline): transformer.py the model, text.py the prompt
encoding, weights.py config and key maps, family.py the rest. Each piece is tested against diffusers in
tests/test_z_image.py."""
