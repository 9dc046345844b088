"""Building one graph's OpenVINO models, one module per build.

* :mod:`~ov_backend.build.builder`: :class:`GraphBuilder`, which picks the build for a signature;
* :mod:`~ov_backend.build.dynamic`: a symbolic-shape graph converted once, compiled per signature;
* :mod:`~ov_backend.build.shared_shapes`: that model compiled once for all shapes, lent between graphs;
* :mod:`~ov_backend.build.static`: a graph traced per signature, partitioned and converted;
* :mod:`~ov_backend.build.int8`: float calls recorded, then a model quantized with NNCF;
* :mod:`~ov_backend.build.keys`: the cache keys of all of them;
* :mod:`~ov_backend.build.target`: :class:`BuildTarget`, the graph, its keys and decompositions, which they share.

What the builds keep per set of weights is a :class:`~ov_backend.variants.WeightSet`.
"""

from ov_backend.build.builder import GraphBuilder

__all__ = ["GraphBuilder"]
