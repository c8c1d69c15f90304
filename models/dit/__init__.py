"""tessera's DiT, the `dit` family (models/dit/family.py): its transformer (transformer.py) and Wan 2.1 / 2.2
folders in (wan.py) and out (wan_export.py)."""
