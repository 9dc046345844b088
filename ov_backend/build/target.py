"""The graph a build works on: :class:`BuildTarget`, what all builds of one graph share, made once per graph.

The builds (:mod:`~ov_backend.build.dynamic`, :mod:`~ov_backend.build.shared_shapes`,
:mod:`~ov_backend.build.static` with its :mod:`~ov_backend.build.partitions`, and
:mod:`~ov_backend.build.int8`) each take this one object instead of the same fields one by one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ov_backend.build.keys import GraphKeys
from ov_backend.context import BuildContext
from ov_backend.inputs import GraphInputs
from ov_backend.ops import decomposition_table

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildTarget:
    """One graph as its builds see it (frozen: the builds share it, none changes it).

    Attributes:
        context: what the backend lends (settings, OpenVINO core, cache, counters, report sink).
        inputs: the graph's inputs and outputs.
        name: the graph's name for logs and reports.
        keys: the graph's cache keys.
        decompositions: the decomposition table tracing uses.
    """

    context: BuildContext
    inputs: GraphInputs
    name: str
    keys: GraphKeys
    decompositions: dict[Any, Callable[..., Any]]

    @classmethod
    def of(cls, context: BuildContext, inputs: GraphInputs, name: str) -> BuildTarget:
        """The graph ``inputs`` describe, with its cache keys and decomposition table from the context's
        settings."""
        settings = context.settings
        return cls(context, inputs, name, GraphKeys(settings, context.versions, inputs.gm.code, inputs.dynamic_dims),
                   decomposition_table(settings.decompositions))
