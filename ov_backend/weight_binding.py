"""A converted model whose constants are the graph's own weight tensors.

OpenVINO's PyTorch frontend makes a weight tensor's constant share its memory with the tensor (for a
contiguous tensor of a type OpenVINO has). A model converted that way reads its weights at compile
time: after the weights were changed in place (A1111's LoRA code writes ``weight.copy_(...)``; a
checkpoint load does the same), compiling the model again gives a compiled model of the new weights
without converting anything. :class:`WeightBoundModel` records, right after a conversion, which weights
the model shares and which it holds a copy of (e.g. a layer norm's weight the frontend reshaped), and
answers whether the model still stands for a given set of weights: the same tensor objects at the
same addresses, and every weight it copied unchanged. For the disk cache, :func:`weightless_copy` turns
the shared constants into named parameters and :func:`attach_weights` binds the tensors to them again.

A constant that the frontend derived from a weight (a transposed or converted copy) would not follow
the tensor. Such a copy has the weight's element count and kind (float or integer): every weight
with the element count and kind of a constant that is not shared is treated as copied, so it must be
unchanged for the model to be reused. Integer constants (shapes, axes, permutations) are never
copies of a float weight: an SD UNet's 4-element output bias, beside its many 4-element shape
constants, is read from the tensor like any other weight, so a checkpoint loaded in place costs a
compile, not a conversion.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import numpy as np
import openvino as ov
import torch

logger = logging.getLogger(__name__)


def _numel(op: ov.Node) -> int:
    n = 1
    for d in op.get_output_shape(0):
        n *= int(d)
    return n


class _Constant:
    """One constant of a model: where its data is, and whether it could be derived from a weight."""

    def __init__(self, op: ov.Node) -> None:
        #: only a floating-point constant can be a copy of a float weight (shapes and axes are integers)
        self.real = op.get_output_element_type(0).is_real()
        try:
            data = op.get_data()
        except (RuntimeError, TypeError, ValueError):  # a type numpy cannot view: no address to compare
            self.memory: tuple[int, int] | None = None
            self.numel = _numel(op)
        else:
            self.memory = (data.ctypes.data, data.nbytes)
            self.numel = int(data.size)


def _constants(model: ov.Model) -> list[_Constant]:
    return [_Constant(op) for op in model.get_ordered_ops() if op.get_type_name() == "Constant"]


class WeightBoundModel:
    """A converted model and the weights it shares memory with.

    Args:
        model: the model right after conversion from ``weight_values``.
        weight_values: the graph's weights, in graph-input order.
        digests: each weight's content digest at conversion (:func:`ov_backend.weights.digests`).
    """

    def __init__(self, model: ov.Model, weight_values: Sequence[torch.Tensor], digests: Sequence[bytes],
                 weights_were_inputs: bool = False) -> None:
        if weights_were_inputs:
            # converted with the weights as inputs, then bound (:func:`attach_weights`): the model reads
            # each weight it uses from the tensor, and holds no value derived from one
            shared = [True] * len(weight_values)
        else:
            own = {(t.data_ptr(), t.numel() * t.element_size()) for t in weight_values if t.is_contiguous()}
            constants = _constants(model)
            memory = {c.memory for c in constants if c.memory is not None}
            # (element count, float?) of constants that are not a weight's own memory: possible copies of a
            # weight of that count and kind (a float copy of a float weight, an integer one of an integer buffer)
            foreign = {(c.numel, c.real) for c in constants if c.memory not in own}
            shared = [t.is_contiguous() and (t.data_ptr(), t.numel() * t.element_size()) in memory
                      and (t.numel(), t.is_floating_point()) not in foreign for t in weight_values]
        self.model = model
        #: converted with the weights as inputs: nothing of them is in the model but the tensors themselves
        self.weights_were_inputs = weights_were_inputs
        self._tensors = [weakref.ref(t) for t in weight_values]
        self._addresses = [t.data_ptr() for t in weight_values]
        self._copied = {i: digests[i] for i, s in enumerate(shared) if not s}
        self._digests = tuple(digests)
        #: bytes of weights the model reads from the tensors themselves
        self.shared_bytes = sum(t.numel() * t.element_size() for t, s in zip(weight_values, shared) if s)
        #: bytes of weights the model holds copies of (these must not change for the model to be reused)
        self.copied_bytes = sum(t.numel() * t.element_size() for t, s in zip(weight_values, shared) if not s)

    def check(self, weight_values: Sequence[torch.Tensor], digests: Sequence[bytes]) -> bool | None:
        """None when compiling :attr:`model` would not give these weights; otherwise whether they differ
        from the ones it was converted from (changed in place since)."""
        if not self.serves(weight_values, digests):
            return None
        return tuple(digests) != self._digests

    def serves(self, weight_values: Sequence[torch.Tensor], digests: Sequence[bytes]) -> bool:
        """Whether compiling :attr:`model` now gives exactly these weights."""
        if len(weight_values) != len(self._tensors) or not self.shared_bytes:
            return False
        for t, ref, address in zip(weight_values, self._tensors, self._addresses):
            if ref() is not t or t.data_ptr() != address:
                return False
        return all(digests[i] == digest for i, digest in self._copied.items())


#: name prefix of the parameters that stand for weight tensors in a stored model (see :func:`weightless_copy`)
WEIGHT_PARAMETER = "__ov_weight_"


def bindable(t: torch.Tensor) -> bool:
    """Whether a constant can read ``t``'s memory (a contiguous CPU tensor)."""
    return t.device.type == "cpu" and t.is_contiguous()


def _shared_constant(t: torch.Tensor) -> ov.Node:
    """A constant that reads ``t``'s memory (contiguous CPU tensor)."""
    if t.dtype == torch.bfloat16:
        tensor = ov.Tensor(t.view(torch.int16).numpy().view(np.uint16), list(t.shape), ov.Type.bf16)
        return ov.op.Constant(tensor, shared_memory=True)
    return ov.op.Constant(t.numpy(), shared_memory=True)


def weightless_copy(model: ov.Model, weight_values: Sequence[torch.Tensor]) -> ov.Model:
    """A copy of ``model`` for the disk: each constant that is a weight tensor's own memory becomes a
    parameter named after the weight's position (``__ov_weight_<i>``), so the file holds no copy of
    the weights. :func:`attach_weights` puts the tensors back."""
    copy = model.clone()
    by_memory = {(t.data_ptr(), t.numel() * t.element_size()): i for i, t in enumerate(weight_values) if bindable(t)}
    added = []
    for op in copy.get_ordered_ops():
        if op.get_type_name() != "Constant":
            continue
        try:
            data = op.get_data()
        except (RuntimeError, TypeError, ValueError):
            continue
        index = by_memory.get((data.ctypes.data, data.nbytes))
        if index is None:
            continue
        param = ov.op.Parameter(op.get_output_element_type(0), ov.PartialShape(op.get_output_shape(0)))
        param.set_friendly_name(f"{WEIGHT_PARAMETER}{index}")
        op.output(0).replace(param.output(0))
        added.append(param)
    if added:
        copy.add_parameters(added)
        copy.validate_nodes_and_infer_types()
    return copy


def name_weight_inputs(model: ov.Model, first: int, count: int) -> ov.Model | None:
    """Name the parameters ``first .. first + count - 1`` of a model converted with the weights as its
    last inputs as :func:`attach_weights` expects (``__ov_weight_<i>``); None when it has other inputs."""
    params = model.get_parameters()
    if len(params) != first + count:
        return None
    for i, param in enumerate(params[first:]):
        param.set_friendly_name(f"{WEIGHT_PARAMETER}{i}")
    return model


def attach_weights(model: ov.Model, weight_values: Sequence[torch.Tensor]) -> ov.Model | None:
    """Give a model stored by :func:`weightless_copy`, or converted with the weights as inputs
    (:func:`name_weight_inputs`), its weights: each weight parameter becomes a constant reading the
    tensor itself. None when a tensor does not fit its parameter (then the
    stored model is not of these weights' graph)."""
    params = [p for p in model.get_parameters() if p.get_friendly_name().startswith(WEIGHT_PARAMETER)]
    for param in params:
        index = int(param.get_friendly_name()[len(WEIGHT_PARAMETER):])
        if index >= len(weight_values):
            return None
        t = weight_values[index]
        if not bindable(t):
            return None
        wanted = param.get_output_partial_shape(0)
        if wanted.is_static:
            # the conversion may have made a view of another shape (a bias as [1, C, 1, 1]): same memory
            shape = [int(d) for d in wanted.to_shape()]
            if t.numel() != int(np.prod(shape, dtype=np.int64)):
                return None
        elif wanted.compatible(ov.PartialShape(list(t.shape))):
            shape = list(t.shape)  # a weight input of the conversion (dynamic as converted): the tensor's own
        else:
            return None
        const = _shared_constant(t.detach().view(shape))
        if const.get_output_element_type(0) != param.get_output_element_type(0):
            return None
        param.output(0).replace(const.output(0))
        model.remove_parameter(param)
    if params:
        model.validate_nodes_and_infer_types()
    return model
