"""sd-webui-controlnet's models in a generation: which of them OpenVINO runs, and why not the others.

ControlNet loads its models and hooks the UNet in its script's ``process`` (``before_process_batch`` with an
SDXL refiner); its hook (``latest_network``, a ``UnetHook``) keeps one ``ControlParams`` per enabled unit, in
``control_params``. A unit of type ControlNet (or ControlNet Union) holds a ``PlugableControlModel`` whose
``control_model`` is the network itself (``cldm.ControlNet``): its ``forward(x, hint, timesteps, context, y,
control_type)`` returns the residuals ControlNet adds to the UNet. That network is routed like a part of the
model, compiled once per model object: a new control image, weight, guidance range or control mode changes
only its inputs or what ControlNet does with its output. Other unit types (T2I-Adapter, IP-Adapter,
reference-only, ...) run in PyTorch, said once per generation.

Nothing here imports ControlNet: its objects are read by their attribute names (v1.1.455).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from .model_parts import Target

logger = logging.getLogger(__name__)

#: The label the control networks are routed under (one compiled route per network object).
LABEL = "controlnet.control_model"

#: ControlNet's unit types whose network OpenVINO runs (``ControlModelType`` names).
TAKEN_TYPES = ("ControlNet", "ControlNetUnion")


@dataclass(frozen=True)
class ControlUnit:
    """One enabled ControlNet unit of the generation."""

    index: int
    kind: str
    """Its ``ControlModelType`` name, e.g. "ControlNet", "T2I_Adapter", "AttentionInjection"."""
    network: nn.Module | None
    """The network OpenVINO runs (None: the unit runs in PyTorch, :attr:`why` says why)."""
    why: str = ""


def control_units(p: Any) -> list[ControlUnit]:
    """The enabled ControlNet units of the generation ``p`` (empty without ControlNet or its hook)."""
    runner = getattr(p, "scripts", None)
    units: list[ControlUnit] = []
    for script in getattr(runner, "alwayson_scripts", None) or ():
        params = getattr(getattr(script, "latest_network", None), "control_params", None)
        for param in params or ():
            kind = str(getattr(getattr(param, "control_model_type", None), "name", "unknown"))
            network = getattr(getattr(param, "control_model", None), "control_model", None)
            if kind not in TAKEN_TYPES:
                why = (f"ControlNet unit {len(units) + 1} is of type {kind}, whose model OpenVINO does not run here "
                       f"(it does: {', '.join(TAKEN_TYPES)})")
                units.append(ControlUnit(len(units), kind, None, why))
            elif not isinstance(network, nn.Module) or getattr(param.control_model, "is_control_lora", False):
                units.append(ControlUnit(len(units), kind, None, f"ControlNet unit {len(units) + 1}'s model is a "
                                         "control LoRA or of an unknown layout"))
            else:
                units.append(ControlUnit(len(units), kind, network))
    return units


def control_targets(units: list[ControlUnit]) -> list[Target]:
    """A target for each distinct network of ``units`` OpenVINO runs."""
    seen: dict[int, Target] = {}
    for unit in units:
        if unit.network is not None and id(unit.network) not in seen:
            seen[id(unit.network)] = Target("unet", LABEL, unit.network)
    return list(seen.values())
