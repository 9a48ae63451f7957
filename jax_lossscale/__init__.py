"""Loss scaling for mixed-precision training in JAX."""

from jax_lossscale._base import LossScale as LossScale
from jax_lossscale._dynamic import DynamicLossScale as DynamicLossScale
from jax_lossscale._dynamic import DynamicLossScaleState as DynamicLossScaleState
from jax_lossscale._fixed import FixedLossScale as FixedLossScale
from jax_lossscale._fixed import FixedLossScaleState as FixedLossScaleState
from jax_lossscale._serialization import deserialize as deserialize
from jax_lossscale._serialization import get as get
from jax_lossscale._serialization import register as register
from jax_lossscale._serialization import serialize as serialize
from jax_lossscale._tree import all_finite as all_finite

__all__ = [
    "DynamicLossScale",
    "DynamicLossScaleState",
    "FixedLossScale",
    "FixedLossScaleState",
    "LossScale",
    "all_finite",
    "deserialize",
    "get",
    "register",
    "serialize",
]
