"""The non-finite output check of routed calls at automatic precision, and what a switch to f32 records.

At automatic precision OpenVINO runs a part in the device's fastest precision (bf16 on CPUs with
AVX-512 BF16 or AMX, f16 on GPUs). f16 overflows at 65504, so a UNet, VAE or text encoder that
computes fine in f32 can return inf or NaN there. The accelerator checks each routed call's output at
automatic precision with :func:`all_finite` (one pass over the output, small next to the call that made
it); on a non-finite output whose inputs were finite it runs the same call through an f32 build of that
route, returns that result, and keeps the route at f32 (an :class:`F32Switch` says why). At f32 nothing
is checked: there is no higher precision to fall back to, and A1111's own NaN check
(``devices.test_for_nans``) reports a model's own NaN.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating-point tensors in ``value`` (a tensor, or tuples, lists and dicts of them, such as
    transformers' ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def all_finite(*values: Any) -> bool:
    """True when every floating-point tensor in ``values`` holds only finite numbers."""
    return all(bool(torch.isfinite(t).all()) for value in values for t in _tensors(value))


@dataclass(frozen=True)
class F32Switch:
    """A route that runs at f32 although the generation asked for automatic precision."""

    part: str
    """The part's short name ("UNet", "VAE", "TE")."""
    finite_at_f32: bool
    """Whether the f32 run of the call that overflowed was finite (False: the model's own NaN or inf)."""

    def describe(self) -> str:
        """E.g. "output not finite at automatic precision (finite at f32)"."""
        if self.finite_at_f32:
            return "output not finite at automatic precision, finite at f32"
        return (
            "output not finite at automatic precision nor at f32: the model's own NaN/inf, "
            "returned as is for A1111's NaN check"
        )
