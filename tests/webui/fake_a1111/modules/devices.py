"""Fake ``modules.devices``: A1111 v1.10.1's NaN check.

``test_for_nans(x, where)`` looks at the first element of ``x`` only (a NaN there stands for a broken
result) and raises :class:`NansException` naming the part ("unet": "... produced in Unet.", "vae":
"... produced in VAE."); ``--disable-nan-check`` (``shared.cmd_opts.disable_nan_check``) turns it off.
``processing`` checks the sampled latent ("unet") and each decoded image ("vae").
"""

from __future__ import annotations

import torch

from modules import shared

PARTS = {"unet": "Unet", "vae": "VAE"}


class NansException(Exception):
    pass


def test_for_nans(x: torch.Tensor, where: str) -> None:
    if shared.cmd_opts.disable_nan_check or not torch.isnan(x[(0,) * x.dim()]):
        return
    part = PARTS.get(where)
    message = f"A tensor with NaNs was produced in {part}." if part else "A tensor with NaNs was produced."
    raise NansException(message + " Use --disable-nan-check commandline argument to disable this check.")
