"""The FLUX.2 family (Black Forest Labs; diffusers' Flux2KleinPipeline): transformer.py the model, text.py the
prompt encoding, weights.py config and key maps, family.py the rest. Each piece is tested against diffusers in
tests/test_flux2.py."""
