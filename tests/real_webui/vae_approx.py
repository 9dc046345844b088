"""A random SDXL approximate VAE (``VAE-approx/vaeapprox-sdxl.pt``) for the test beds' live previews: the WebUI
and Forge would download the trained one on the first SDXL generation, which fails offline. Written by the A1111
bed's ``make_models_sdxl_sd2.py`` and the Forge bed's ``tests/real_forge/make_models_sdxl.py``; imports nothing
beyond torch (run by either bed's Python).
"""

from __future__ import annotations

import os


def write_vae_approx_sdxl(models: str) -> None:
    """A random ``VAE-approx/vaeapprox-sdxl.pt`` in the layout of the WebUI's ``sd_vae_approx.VAEApprox``: eight
    unpadded convs (4 -> 8 -> 16 -> 32 -> 64 -> 32 -> 16 -> 8 -> 3 channels; kernels 7, 5, then 3)."""
    import torch

    torch.manual_seed(6)
    channels = [4, 8, 16, 32, 64, 32, 16, 8, 3]
    kernels = [7, 5, 3, 3, 3, 3, 3, 3]
    state = {}
    for i, kernel in enumerate(kernels):
        conv = torch.nn.Conv2d(channels[i], channels[i + 1], kernel)
        state.update({f"conv{i + 1}.{k}": v for k, v in conv.state_dict().items()})
    folder = os.path.join(models, "VAE-approx")
    os.makedirs(folder, exist_ok=True)
    torch.save(state, os.path.join(folder, "vaeapprox-sdxl.pt"), _use_new_zipfile_serialization=False)
