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
from jax_lossscale._model_state import where_applied as where_applied
from jax_lossscale._numerics import all_finite as all_finite
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
    "non_finite_paths",
    "register",
    "serialize",
    "stochastic_rounding",
    "value_and_grad",
    "where_applied",
    "__version__",
]

import typing as _typing

# Names of jmp's and mpx's APIs that jax_lossscale does not have, and what to write instead:
# `import jax_lossscale as jmp` keeps jmp's casting code working, and these say where the rest
# went. They are not part of the API (not in `__all__` nor `dir`).
_PEER_NAMES = {
    "NoOpLossScale": (
        "jmp",
        "a step that selects on all_finite is DynamicLossScale(initial_loss_scale=1.0, "
        "max_loss_scale=1.0) (scale 1, non-finite steps skipped); a step that applies every "
        "step is FixedLossScale(1.0); either goes into loss_scaled(optimizer, loss_scale)",
    ),
    "StaticLossScale": (
        "jmp",
        "StaticLossScale(v) is DynamicLossScale(initial_loss_scale=v, min_loss_scale=v, "
        "max_loss_scale=v) where the step selects on all_finite (non-finite steps skipped), "
        "FixedLossScale(v) where every step is applied; either goes into "
        "loss_scaled(optimizer, loss_scale)",
    ),
    "select_tree": (
        "jmp",
        "tx = loss_scaled(optimizer, loss_scale) skips a non-finite step in tx.update (its "
        "updates are -0.0, the optimizer state is kept); other state, such as a model's "
        "BatchNorm statistics, is where_applied(opt_state, new_state, state) after tx.update",
    ),
    "DynamicLossScaling": (
        "mpx",
        "DynamicLossScale(initial_loss_scale=loss_scaling, increment_period=period, "
        "multiplier=factor, min_loss_scale=min_loss_scaling, max_loss_scale=max(loss_scaling, "
        "2.0**15)) inside loss_scaled(optimizer, loss_scale)",
    ),
    "filter_value_and_grad": (
        "mpx",
        "value_and_grad(loss_fn, opt_state, using=eqx.filter_value_and_grad) gives the "
        "scaled gradients that tx.update takes; mpx's also casts every argument to half "
        "precision, which here is cast_to_half(model), cast_to_half(batch) before the call",
    ),
    "force_full_precision": (
        "mpx",
        "full_precision(fn, output_dtype=...); mpx's returns half precision by default, "
        "full_precision float32",
    ),
    "optimizer_update": (
        "mpx",
        "updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, "
        "eqx.is_inexact_array)), then eqx.apply_updates(model, updates)",
    ),
}


if not _typing.TYPE_CHECKING:  # so that type checkers still flag a misspelt name

    def __getattr__(name):
        if name in _PEER_NAMES:
            peer, instead = _PEER_NAMES[name]
            raise AttributeError(
                f"module 'jax_lossscale' has no attribute {name!r}, {peer}'s name: {instead} "
                "(docs/migrating.md)",
                name=None,  # no "Did you mean" a name of ours that is not the mapping
                obj=None,
            )
        raise AttributeError(f"module 'jax_lossscale' has no attribute {name!r}")
