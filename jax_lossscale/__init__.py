"""Loss scaling for mixed-precision training in JAX."""

from jax_lossscale._base import LossScale as LossScale
from jax_lossscale._bf16_weights import KahanSummationState as KahanSummationState
from jax_lossscale._bf16_weights import StochasticRoundingState as StochasticRoundingState
from jax_lossscale._bf16_weights import kahan_summation as kahan_summation
from jax_lossscale._bf16_weights import stochastic_rounding as stochastic_rounding
from jax_lossscale._diagnostics import LossScaleStuckError as LossScaleStuckError
from jax_lossscale._diagnostics import check_not_stuck as check_not_stuck
from jax_lossscale._diagnostics import count_non_finite as count_non_finite
from jax_lossscale._diagnostics import non_finite_paths as non_finite_paths
from jax_lossscale._dynamic import DynamicLossScale as DynamicLossScale
from jax_lossscale._dynamic import DynamicLossScaleState as DynamicLossScaleState
from jax_lossscale._fixed import FixedLossScale as FixedLossScale
from jax_lossscale._fixed import FixedLossScaleState as FixedLossScaleState
from jax_lossscale._lookup import get_loss_scale as get_loss_scale
from jax_lossscale._lookup import get_loss_scale_stats as get_loss_scale_stats
from jax_lossscale._loss_scaled import loss_scaled as loss_scaled
from jax_lossscale._low_precision_state import LowPrecisionState as LowPrecisionState
from jax_lossscale._low_precision_state import low_precision_state as low_precision_state
from jax_lossscale._model_state import where_applied as where_applied
from jax_lossscale._numerics import all_finite as all_finite
from jax_lossscale._peer_hints import module_attribute_error as _module_attribute_error
from jax_lossscale._policy import Policy as Policy
from jax_lossscale._policy import cast_to_full as cast_to_full
from jax_lossscale._policy import cast_to_half as cast_to_half
from jax_lossscale._policy import cast_tree as cast_tree
from jax_lossscale._policy import full_precision as full_precision
from jax_lossscale._policy import get_policy as get_policy
from jax_lossscale._policy import half_dtype as half_dtype
from jax_lossscale._serialization import deserialize as deserialize
from jax_lossscale._serialization import get as get
from jax_lossscale._serialization import register as register
from jax_lossscale._serialization import serialize as serialize
from jax_lossscale._spikes import RecentValues as RecentValues
from jax_lossscale._spikes import SpikeWindows as SpikeWindows
from jax_lossscale._states import LossScaledState as LossScaledState
from jax_lossscale._states import LossScaleStats as LossScaleStats
from jax_lossscale._states import StepStats as StepStats
from jax_lossscale._value_and_grad import value_and_grad as value_and_grad
from jax_lossscale._version import version as _version

__version__: str = _version()

__all__ = [
    "DynamicLossScale",
    "DynamicLossScaleState",
    "FixedLossScale",
    "FixedLossScaleState",
    "KahanSummationState",
    "LossScale",
    "LossScaleStats",
    "LossScaleStuckError",
    "LossScaledState",
    "LowPrecisionState",
    "Policy",
    "RecentValues",
    "SpikeWindows",
    "StepStats",
    "StochasticRoundingState",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "cast_tree",
    "check_not_stuck",
    "count_non_finite",
    "deserialize",
    "full_precision",
    "get",
    "get_loss_scale",
    "get_loss_scale_stats",
    "get_policy",
    "half_dtype",
    "kahan_summation",
    "loss_scaled",
    "low_precision_state",
    "non_finite_paths",
    "register",
    "serialize",
    "stochastic_rounding",
    "value_and_grad",
    "where_applied",
    "__version__",
]

import typing as _typing

if not _typing.TYPE_CHECKING:  # so that type checkers still flag a misspelt name

    def __getattr__(name):
        raise _module_attribute_error(name)
