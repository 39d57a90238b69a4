"""Compressor state in training checkpoints: everything a zerosum.compression.Compressor holds, as
tensors and plain values that torch.save / torch.load (weights_only) keep exactly, and back."""
from __future__ import annotations

import random
import sys

import numpy as np
import torch


_TAG = "__zerosum__"


def _key_ok(k) -> bool:
    return isinstance(k, (str, int, float, bool)) or k is None or (isinstance(k, tuple) and all(map(_key_ok, k)))


def _encode(value, where: str):
    """`value` as plain containers, numbers, strings and tensors: what torch.save writes and
    torch.load(weights_only=True) reads back."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, np.generic):
        return {_TAG: "scalar", "dtype": value.dtype.str, "value": value.item()}
    if isinstance(value, np.ndarray):
        try:
            return {_TAG: "ndarray", "value": torch.from_numpy(np.array(value, copy=True))}
        except TypeError:
            raise TypeError(f"{where}: cannot save an array of dtype {value.dtype}") from None
    if isinstance(value, torch.Tensor):
        return {_TAG: "tensor", "value": value.detach().clone()}
    if isinstance(value, np.random.Generator):
        return {_TAG: "generator", "state": value.bit_generator.state}
    if isinstance(value, np.random.RandomState):
        return {_TAG: "randomstate", "state": _encode(value.get_state(legacy=False), where)}
    if isinstance(value, random.Random):
        return {_TAG: "pyrandom", "state": value.getstate()}
    if isinstance(value, tuple):
        return tuple(_encode(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not _key_ok(k)]
        if bad:
            raise TypeError(f"{where}: cannot save the key {bad[0]!r} "
                            "(keys must be strings, numbers or tuples of them)")
        return {_TAG: "dict", "items": [(k, _encode(v, f"{where}[{k!r}]")) for k, v in value.items()]}
    if hasattr(value, "__dict__") and not callable(value):
        return {_TAG: "object", "class": _class_name(value),
                "attrs": {k: _encode(v, f"{where}.{k}") for k, v in vars(value).items()}}
    raise TypeError(f"{where}: cannot save a {type(value).__name__} in a checkpoint")


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _new_restorable(class_name: str):
    """An empty object of `class_name` for state that a compressor makes during training (per-key
    objects, which a fresh compressor does not have yet), if that class says so (`restore_new`) and its
    module is loaded; else None. Nothing is imported, and no other class is made from a checkpoint."""
    module, _, name = class_name.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    return cls.__new__(cls) if isinstance(cls, type) and getattr(cls, "restore_new", False) is True else None


def _restore(current, enc, where: str):
    """The value `enc` (from _encode) stands for; objects, dicts, lists and random generators that
    exist already (`current`) are updated in place, so references to them stay valid."""
    if isinstance(enc, dict) and _TAG in enc:
        kind = enc[_TAG]
        if kind == "object":
            if current is None:
                current = _new_restorable(enc["class"])
            if current is None or _class_name(current) != enc["class"]:
                have = "nothing" if current is None else f"a {_class_name(current)}"
                raise ValueError(f"{where}: the checkpoint holds a {enc['class']}, this run has {have}")
            attrs = vars(current)
            for k, e in enc["attrs"].items():
                attrs[k] = _restore(attrs.get(k), e, f"{where}.{k}")
            return current
        if kind == "dict":
            old = current if isinstance(current, dict) else {}
            items = [(k, _restore(old.get(k), e, f"{where}[{k!r}]")) for k, e in enc["items"]]
            if isinstance(current, dict):
                current.clear()
                current.update(items)
                return current
            return dict(items)
        if kind == "ndarray":
            return enc["value"].cpu().numpy().copy()
        if kind == "tensor":
            t = enc["value"].clone()
            return t.to(current.device) if isinstance(current, torch.Tensor) else t
        if kind == "scalar":
            return np.dtype(enc["dtype"]).type(enc["value"])
        if kind == "generator":
            state = enc["state"]
            if not isinstance(current, np.random.Generator) or \
                    type(current.bit_generator).__name__ != state["bit_generator"]:
                current = np.random.Generator(getattr(np.random, state["bit_generator"])())
            current.bit_generator.state = state
            return current
        if kind == "randomstate":
            current = current if isinstance(current, np.random.RandomState) else np.random.RandomState()
            current.set_state(_restore(None, enc["state"], where))
            return current
        if kind == "pyrandom":
            current = current if isinstance(current, random.Random) else random.Random()
            current.setstate(_restore(None, enc["state"], where))
            return current
        raise ValueError(f"{where}: unknown entry {kind!r} in the checkpoint")
    if isinstance(enc, (tuple, list)):
        old = current if isinstance(current, (tuple, list)) and len(current) == len(enc) else [None] * len(enc)
        values = [_restore(o, e, f"{where}[{i}]") for i, (o, e) in enumerate(zip(old, enc))]
        if isinstance(enc, tuple):
            return tuple(values)
        if isinstance(current, list):
            current[:] = values
            return current
        return values
    return enc


def compressor_state_dict(compressor) -> dict:
    """Everything a zerosum.compression.Compressor holds (its per-key state such as error-feedback
    memory, DIANA shifts and DGC accumulators, its random generators, step sizes, epochs and
    settings), as tensors and plain values that torch.save/torch.load (weights_only) keep exactly."""
    return _encode(compressor, type(compressor).__name__)


def load_compressor_state_dict(compressor, state: dict) -> None:
    """Put what `compressor_state_dict` saved back into `compressor` (of the same class), in place."""
    _restore(compressor, state, type(compressor).__name__)
