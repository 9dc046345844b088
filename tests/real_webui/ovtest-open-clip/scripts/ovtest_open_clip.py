"""Test-only extension of the real-host tier: makes the tier's tiny open_clip architecture known to the WebUI.

The tier's SDXL and SD 2.x checkpoints (``make_models_sdxl_sd2.py``) name ``arch: ovtest-open-clip-tiny`` in
their ``.yaml``, a small stand-in for OpenCLIP-bigG and -H that open_clip builds from the JSON in this
extension's ``model_configs/`` (as it builds its own architectures from its package's ``model_configs/``).
The WebUI loads extension scripts before any checkpoint, so registering it when this file is loaded is early
enough. Nothing else of the WebUI changes: its own sgm/LDM classes build the models, and open_clip is asked
for no pretrained weights (the checkpoint holds them).
"""

import os

import open_clip

open_clip.add_model_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_configs"))
