"""`FixedLossScale`: a loss scale that never changes."""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_lossscale import _checks
from jax_lossscale._base import LossScale, check_loss_scale_state, init_fields
from jax_lossscale._checks import check_grads_finite


class FixedLossScaleState(NamedTuple):
    """State of a `FixedLossScale`: the scale as a float32 scalar array.

    Examples:
      >>> import jax_lossscale as jls
      >>> jls.FixedLossScale(8.0).init()
      FixedLossScaleState(loss_scale=Array(8., dtype=float32))
    """

    loss_scale: jax.Array  # float32 scalar


@dataclasses.dataclass(frozen=True)
class FixedLossScale(LossScale):
    """A loss scale that stays at `loss_scale_value` for ever.

    `update` never skips a step: a fixed scale cannot react to an overflow, so
    non-finite gradients are applied, NaN and inf included, as TensorFlow's
    `FixedLossScale` does. To skip them at a constant scale, use a `DynamicLossScale`
    that cannot move (`initial_loss_scale=max_loss_scale=min_loss_scale`), or give
    `loss_scaled` a spike option, under which every loss scale skips non-finite steps.

    Args:
      loss_scale_value: the scale, a real number >= 1.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> ls = jls.FixedLossScale(2.0**10)
      >>> state = ls.init()
      >>> ls(state)
      Array(1024., dtype=float32)
      >>> state, should_apply = ls.update(state, {"w": jnp.array([jnp.nan])})
      >>> should_apply
      Array(True, dtype=bool)
    """

    loss_scale_value: float

    def __post_init__(self) -> None:
        value = _checks.real(type(self).__name__, "loss_scale_value", self.loss_scale_value)
        if value < 1:
            _checks.fail(type(self).__name__, "loss_scale_value", self.loss_scale_value, ">= 1")
        object.__setattr__(self, "loss_scale_value", value)

    def init(self) -> FixedLossScaleState:
        """Returns the state: the scale, `loss_scale_value`, as a float32 scalar array."""
        return FixedLossScaleState(loss_scale=jnp.asarray(self.loss_scale_value, jnp.float32))

    def adjust(
        self, state: FixedLossScaleState, grads_finite: jax.Array
    ) -> tuple[FixedLossScaleState, jax.Array]:
        """Returns the state of this scale and `should_apply` true, whatever `grads_finite`.

        A state made with another `loss_scale_value` (a run resumed with a changed
        setting) holds this one after the update.

        Examples:
          >>> import jax.numpy as jnp
          >>> import jax_lossscale as jls
          >>> ls = jls.FixedLossScale(8.0)
          >>> ls.adjust(ls.init(), jnp.array(False))
          (FixedLossScaleState(loss_scale=Array(8., dtype=float32)), Array(True, dtype=bool))
        """
        check_loss_scale_state(self, state)
        check_grads_finite(grads_finite, caller="FixedLossScale.adjust")
        return self.init(), jnp.array(True)

    def get_config(self) -> dict[str, Any]:
        """Returns `{"loss_scale_value": ...}` (and a subclass's own fields), which
        `from_config` takes back."""
        return init_fields(self)
