"""The cache keys of a graph's models: one recipe, one method per kind of model.

Every model the builds store or look up in the disk cache (:class:`~ov_backend.cache.ModelCache`) is
found under a key made by :func:`model_key`: what the model is, the signature it was built for, the
weights' fingerprint (None: the model holds no weights, so one entry serves every checkpoint and
LoRA), the settings that change it, the library versions, and what else decides it (the graph's
code, its dynamic dimensions, the INT8 calibration). :class:`GraphKeys` names each kind of model one
graph makes, so that no build spells the recipe itself.

The keys are the names of existing users' cache entries: a change of any part makes every entry of
that kind unreachable (``tests/backend/test_cache_keys.py`` pins them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ov_backend import quantize
from ov_backend.cache import make_key
from ov_backend.settings import BackendSettings


def model_key(settings: BackendSettings, versions: Mapping[str, str], what: str, signature: Any,
              fingerprint: str | None, extra: Mapping[str, Any], scope: str = "device") -> str:
    """The cache key of a model: what it is, its signature, weights, settings and versions.

    ``scope`` says which settings the model depends on: "device" (a model compiled for the device: every
    setting, :meth:`~ov_backend.settings.BackendSettings.result_key`); "conversion" (a model as converted,
    before any device or precision touched it, the dynamic build's: a precision switch reuses it);
    "quantized" (an INT8 model: the device and its config but for the thread placement, which the model
    does not depend on)."""
    chosen = {"device": settings.result_key, "conversion": settings.conversion_key,
              "quantized": settings.quantized_key}[scope]()
    return make_key({"what": what, "signature": repr(signature), "weights": fingerprint,
                     "settings": chosen, "versions": dict(versions), **extra})


def _ranks(sig: Sequence[Any]) -> list[tuple[int, Any]]:
    """A signature as the dynamic build keys it: each input's rank and dtype, not its sizes."""
    return [(len(s[0]), s[1]) for s in sig]


@dataclass(frozen=True)
class GraphKeys:
    """The cache keys of the models of one graph.

    Attributes:
        settings: the backend's settings.
        versions: the library versions (part of every key).
        graph_code: the graph's Python code (``GraphModule.code``).
        dims: the graph's dynamic dimensions (None: traced per signature).
    """

    settings: BackendSettings
    versions: Mapping[str, str]
    graph_code: str
    dims: Any = None

    def _key(self, what: str, signature: Any, fingerprint: str | None, extra: Mapping[str, Any],
             scope: str = "device") -> str:
        return model_key(self.settings, self.versions, what, signature, fingerprint, extra, scope)

    # -- the dynamic build: keyed by the inputs' ranks and dtypes -------------------------------------------
    def dynamic(self, sig: Sequence[Any], fingerprint: str, weights_as_inputs: bool) -> str:
        """The model converted with dynamic shapes. Converted with the weights as inputs, it holds nothing of
        them: one entry serves every checkpoint and LoRA of this graph, and its key names no weights."""
        return self._key("dynamic", _ranks(sig), None if weights_as_inputs else fingerprint,
                         {"graph": self.graph_code, "dims": self.dims,
                          "weights": "inputs" if weights_as_inputs else "baked"},
                         scope="conversion")

    def dynamic_failure(self, sig: Sequence[Any]) -> str:
        """Where a failed dynamic conversion of this graph is remembered (no weights in it)."""
        return self._key("dynamic-failure", _ranks(sig), None, {"graph": self.graph_code, "dims": self.dims})

    def all_shapes(self, sig: Sequence[Any], fingerprint: str) -> str:
        """The model compiled for all shapes of these weights, under which graphs lend it to each other
        (:class:`~ov_backend.variants.SharedModels`): another capture of the same code finds it."""
        return self._key("dynamic for all shapes", _ranks(sig), fingerprint,
                         {"graph": self.graph_code, "dims": self.dims})

    def dynamic_int8(self, sig: Sequence[Any], fingerprint: str) -> str:
        """The INT8 model with dynamic shapes of these weights."""
        return self._key("int8", _ranks(sig), fingerprint,
                         {"graph": self.graph_code, "dims": self.dims,
                          **quantize.calibration_key(self.settings.calibration_samples)}, scope="quantized")

    # -- the static build: keyed by the whole signature -----------------------------------------------------
    def whole(self, sig: Any, fingerprint: str) -> str:
        """The model of the whole graph for ``sig`` (whether the graph is one partition depends on
        ``min_partition_ops``)."""
        return self._key("whole", sig, fingerprint,
                         {"graph": self.graph_code, "min_partition_ops": self.settings.min_partition_ops})

    def static_int8(self, sig: Any, fingerprint: str) -> str:
        """The INT8 model of the whole graph for ``sig``."""
        return self._key("int8", sig, fingerprint,
                         {"graph": self.graph_code, "min_partition_ops": self.settings.min_partition_ops,
                          **quantize.calibration_key(self.settings.calibration_samples)}, scope="quantized")

    def partition(self, name: str, fingerprint: str, code: str, constants: str, inputs: list[str]) -> str:
        """One partition of the static build: its code, the fingerprint of the constants it holds and its
        inputs' example values name it, whatever graph it came from."""
        return self._key("partition", name, fingerprint, {"code": code, "constants": constants, "inputs": inputs})
