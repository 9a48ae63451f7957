"""Loss scales to and from JSON-able dicts: `serialize`, `deserialize`, `register`, `get`."""

import inspect
import numbers
from typing import Any, TypeVar, cast

import jax.numpy as jnp
import numpy as np

from jax_lossscale._base import LossScale
from jax_lossscale._checks import describe, is_array
from jax_lossscale._dynamic import DynamicLossScale
from jax_lossscale._fixed import FixedLossScale

_LossScaleType = TypeVar("_LossScaleType", bound=type[LossScale])

_REGISTRY: dict[str, type[LossScale]] = {
    "DynamicLossScale": DynamicLossScale,
    "FixedLossScale": FixedLossScale,
}


def register(cls: _LossScaleType) -> _LossScaleType:
    """Makes a `LossScale` subclass known to `deserialize` and `get`, by its class name.

    Examples:
      >>> import dataclasses
      >>> import jax_lossscale as jls
      >>> @jls.register
      ... @dataclasses.dataclass(frozen=True)
      ... class MyLossScale(jls.FixedLossScale):
      ...     pass
      >>> jls.deserialize(jls.serialize(MyLossScale(8.0)))
      MyLossScale(loss_scale_value=8.0)
    """
    if not (isinstance(cls, type) and issubclass(cls, LossScale)):
        raise TypeError(f"register(cls={cls!r}): cls must be a subclass of LossScale")
    if inspect.isabstract(cls):
        raise TypeError(
            f"register(cls={cls!r}): cls must be concrete; it leaves abstract "
            f"{sorted(cls.__abstractmethods__)}"
        )
    known = _REGISTRY.get(cls.__name__)
    if known is not None and _qualified_name(known) != _qualified_name(cls):
        raise ValueError(
            f"register(cls={cls!r}): the name {cls.__name__!r} is already registered "
            f"for {_qualified_name(known)}"
        )
    _REGISTRY[cls.__name__] = cls
    return cls


def serialize(loss_scale: LossScale) -> dict[str, Any]:
    """Returns `{"class_name": ..., "config": ...}`, a JSON-able description of `loss_scale`.

    Examples:
      >>> import jax_lossscale as jls
      >>> jls.serialize(jls.FixedLossScale(128))
      {'class_name': 'FixedLossScale', 'config': {'loss_scale_value': 128.0}}
    """
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"serialize(loss_scale={describe(loss_scale, limit=None)}): loss_scale must be a "
            "LossScale instance"
        )
    name = type(loss_scale).__name__
    if _REGISTRY.get(name) is not type(loss_scale):
        raise ValueError(
            f"serialize(loss_scale={describe(loss_scale, limit=None)}): {name} is not "
            "registered, so it could not be deserialized; decorate the class with "
            "@jax_lossscale.register"
        )
    return {"class_name": name, "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> LossScale:
    """Rebuilds a loss scale from the dict returned by `serialize`.

    Examples:
      >>> import jax_lossscale as jls
      >>> jls.deserialize({"class_name": "DynamicLossScale", "config": {"increment_period": 10}})
      DynamicLossScale(initial_loss_scale=32768.0, increment_period=10, ...)
    """
    if not isinstance(config, dict):
        raise TypeError(
            f"deserialize(config={describe(config, limit=None)}): config must be a dict"
        )
    if set(config) != {"class_name", "config"}:
        raise ValueError(
            f"deserialize(config={describe(config, limit=None)}): config must have exactly "
            "the keys 'class_name' and 'config'"
        )
    name = config["class_name"]
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"deserialize(config={describe(config, limit=None)}): unknown class_name "
            f"{name!r}; known: {sorted(_REGISTRY)} (register a LossScale subclass with "
            "@jax_lossscale.register)"
        )
    return cls.from_config(config["config"])


def get(identifier: Any) -> LossScale | None:
    """Turns a loss-scale identifier into a loss scale.

    `None` gives `None`; a number (or a concrete scalar array) gives
    `FixedLossScale(number)`; `"dynamic"` gives `DynamicLossScale()`; a dict is passed to
    `deserialize`; a `LossScale` is returned as it is.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> jls.get(1024)
      FixedLossScale(loss_scale_value=1024.0)
      >>> jls.get(jnp.asarray(2.0**15))  # a concrete scalar array, as jmp writes its scales
      FixedLossScale(loss_scale_value=32768.0)
      >>> jls.get("dynamic") == jls.DynamicLossScale()
      True
    """
    if identifier is None or isinstance(identifier, LossScale):
        return identifier
    if _is_real_scalar_array(identifier):
        # FixedLossScale reads the number a concrete array holds and refuses a traced one.
        return FixedLossScale(identifier)
    if isinstance(identifier, numbers.Real) and not isinstance(identifier, bool):
        # FixedLossScale takes any real number, checks it and keeps it as the float it is typed.
        return FixedLossScale(cast(float, identifier))
    if isinstance(identifier, str) and identifier == "dynamic":
        return DynamicLossScale()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    raise ValueError(
        f"get(identifier={describe(identifier, limit=None)}): identifier must be None, a "
        "number, 'dynamic', a dict from serialize() or a LossScale"
    )


def _is_real_scalar_array(value: Any) -> bool:
    return (
        is_array(value)
        and np.ndim(value) == 0
        and (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer))
    )


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
