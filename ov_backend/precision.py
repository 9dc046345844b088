"""Precision names and the OpenVINO properties each one sets: the one table every layer uses.

The backend's ``precision`` option, the SD layer's ``--precision`` and the WebUI panel's precision
labels are names of :data:`PRECISION_CONFIG`; only the backend turns a name into plugin properties
(``ov_backend.build_settings`` adds them to ``config``). Imports nothing, so the command line can list
the names before torch and OpenVINO are loaded.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Precision name -> the ``compile_model`` properties it sets. "auto": the plugin picks (bf16 or f16
#: where the device has it; results differ slightly from PyTorch); "f32": f32 inference, which
#: matches PyTorch closely; "int8": weights and activations quantized to 8 bits with NNCF, calibrated
#: on the graph's first calls (which run at "auto"), the rest at the plugin's choice as for "auto";
#: "int8-weights": the weights compressed to 8 bits before each compile, the computation at the plugin's choice
#: as for "auto" (least memory; see :mod:`ov_backend.compress`).
PRECISION_CONFIG: dict[str, dict[str, str]] = {
    "auto": {},
    "f32": {"INFERENCE_PRECISION_HINT": "f32"},
    "int8": {},
    "int8-weights": {},
}
#: Precisions whose models are quantized after calibration (see :mod:`ov_backend.quantize`).
QUANTIZED_PRECISIONS: frozenset[str] = frozenset({"int8"})
#: Precisions whose models get 8-bit weights before they are compiled (see :mod:`ov_backend.compress`).
COMPRESSED_PRECISIONS: frozenset[str] = frozenset({"int8-weights"})
#: Precisions that need NNCF.
NNCF_PRECISIONS: frozenset[str] = QUANTIZED_PRECISIONS
#: The names, in the order a choice lists them (the default first).
PRECISIONS: tuple[str, ...] = tuple(PRECISION_CONFIG)
DEFAULT_PRECISION = PRECISIONS[0]
