"""`DynamicLossScale`: a loss scale that grows while gradients are finite and backs off when not."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn, cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _checks
from jax_lossscale._base import LossScale, check_loss_scale_state, init_fields
from jax_lossscale._checks import check_grads_finite


class DynamicLossScaleState(NamedTuple):
    """State of a `DynamicLossScale`: three scalar arrays.

    Examples:
      >>> import jax_lossscale as jls
      >>> jls.DynamicLossScale(hysteresis=2).init()
      DynamicLossScaleState(loss_scale=Array(32768., dtype=float32),
                            good_steps=Array(0, dtype=int32),
                            overflows_until_backoff=Array(2, dtype=int32))
    """

    loss_scale: jax.Array  # float32
    good_steps: jax.Array  # int32: consecutive finite steps since the counter last reset
    overflows_until_backoff: jax.Array  # int32: non-finite steps, this one included, to backoff


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
    """A loss scale that rises while gradients stay finite and falls when they overflow.

    With default arguments this is TensorFlow 2.0's `DynamicLossScale`, step for
    step. Each call of `update` (or of `adjust`, given the finite flag) applies this
    rule (`scale`, `good_steps` and `overflows_until_backoff` are the fields of the
    state):

        # a state made under other hyperparameters is brought within these first
        scale = clip(scale, min_loss_scale, max_loss_scale)  # NaN as min_loss_scale
        overflows_until_backoff = clip(overflows_until_backoff, 1, hysteresis)
        if every gradient is finite:
            good_steps += 1
            if consecutive_hysteresis:
                overflows_until_backoff = hysteresis
            if good_steps >= increment_period:
                if scale * multiplier is finite and <= max_loss_scale:
                    scale = scale * multiplier
                good_steps = 0
                overflows_until_backoff = hysteresis
        else:
            good_steps = 0
            if overflows_until_backoff > 1:
                overflows_until_backoff -= 1
            else:
                reduced = scale * backoff_factor if backoff_factor else scale / multiplier
                scale = max(reduced, min_loss_scale)
        should_apply = every gradient is finite

    Args:
      initial_loss_scale: the scale to start from. Start high: a scale that is
        too high comes down in a few steps, one that is too low takes
        `increment_period` steps per doubling to rise. It only goes into the state
        `init` returns, so it may be traced (the loss scale built inside `jit` or
        `pmap`, from `jnp.float32(2**15)` written there): a traced value cannot be
        checked, and `init` brings it within `[min_loss_scale, max_loss_scale]` (NaN
        to `min_loss_scale`), as `update` does with any state. Such a loss scale
        compares and hashes by its other fields and has no `get_config`.
      increment_period: the number of consecutive finite steps after which the
        scale grows.
      multiplier: the growth factor, > 1; also the backoff divisor unless
        `backoff_factor` is given.
      backoff_factor: if given, in (0, 1): the scale is multiplied by it on backoff.
      min_loss_scale: the floor of the scale. Values below 1 are allowed, down to the
        smallest normal float32 (XLA flushes subnormal numbers to zero on some backends).
      max_loss_scale: the ceiling of the scale; growth past it is refused.
        Defaults to the float32 maximum.
      hysteresis: the number of non-finite steps, counted since the last
        `increment_period` finite steps completed, from which on the scale backs
        off. 1 backs off on every non-finite step.
      consecutive_hysteresis: if true, every finite step (not only a completed
        period) restores the full `hysteresis` tolerance.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> ls = jls.DynamicLossScale(initial_loss_scale=2.0**15, increment_period=2)
      >>> state = ls.init()
      >>> grads = {"w": jnp.array([1.0, jnp.inf])}
      >>> state, should_apply = ls.update(state, grads)
      >>> should_apply, ls(state)
      (Array(False, dtype=bool), Array(16384., dtype=float32))
    """

    initial_loss_scale: float | jax.Array = 2.0**15
    increment_period: int = 2000
    multiplier: float = 2.0
    _: dataclasses.KW_ONLY
    backoff_factor: float | None = None
    min_loss_scale: float = 1.0
    max_loss_scale: float | None = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        received = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

        def normalize(
            name: str, check: Callable[[str, str, Any], Any], optional: bool = False
        ) -> None:
            value = getattr(self, name)
            if not (optional and value is None):
                object.__setattr__(self, name, check(type(self).__name__, name, value))

        normalize("initial_loss_scale", _checks.traced_or_positive_real)
        normalize("increment_period", _checks.integer)
        normalize("multiplier", _checks.real)
        normalize("backoff_factor", _checks.real, optional=True)
        normalize("min_loss_scale", _checks.positive_real)
        normalize("max_loss_scale", _checks.positive_real, optional=True)
        normalize("hysteresis", _checks.integer)
        normalize("consecutive_hysteresis", _checks.boolean)

        def fail(name: str, requirement: str) -> NoReturn:
            used = getattr(self, name)
            if used != received[name]:
                requirement += f" (it rounds to {used!r} in float32)"
            _checks.fail(type(self).__name__, name, received[name], requirement)

        if self.multiplier <= 1:
            fail("multiplier", "> 1")
        if self.backoff_factor is not None and not 0 < self.backoff_factor < 1:
            fail("backoff_factor", "None or in the open interval (0, 1)")
        initial = self.initial_loss_scale
        if self.max_loss_scale is not None and self.max_loss_scale < self.min_loss_scale:
            fail("max_loss_scale", f"None or >= min_loss_scale ({self.min_loss_scale!r})")
        if isinstance(initial, jax.Array):  # traced: init brings it within the bounds
            # What is cached by loss scale (the jitted rule, the state's shapes) is cached by
            # this equal twin, which holds no tracer, so that none outlives its trace.
            untraced = dataclasses.replace(self, initial_loss_scale=self.min_loss_scale)
            object.__setattr__(untraced, "_untraced", untraced)
            object.__setattr__(self, "_untraced", untraced)
            check_loss_scale_state(untraced, untraced.init())
            return
        if initial < self.min_loss_scale:
            fail("initial_loss_scale", f">= min_loss_scale ({self.min_loss_scale!r})")
        if self.max_loss_scale is not None and self.max_loss_scale < initial:
            fail("max_loss_scale", f"None or >= initial_loss_scale ({initial!r})")

    def _fields(self) -> tuple[Any, ...]:
        """The fields that make two loss scales equal, a traced initial scale left out."""
        initial, *others = (getattr(self, field.name) for field in dataclasses.fields(self))
        return (None if "_untraced" in vars(self) else initial, *others)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def init(self) -> DynamicLossScaleState:
        """Returns the first state: the scale at `initial_loss_scale`, no finite steps counted
        and the full `hysteresis` tolerance."""
        scale = jnp.asarray(self.initial_loss_scale, jnp.float32)
        if isinstance(self.initial_loss_scale, jax.Array):  # traced, unchecked
            ceiling, floor = np.float32(self._ceiling), np.float32(self.min_loss_scale)
            scale = jnp.fmin(jnp.fmax(scale, floor), ceiling)
        return DynamicLossScaleState(
            loss_scale=scale,
            good_steps=jnp.asarray(0, jnp.int32),
            overflows_until_backoff=jnp.asarray(self.hysteresis, jnp.int32),
        )

    def adjust(
        self, state: DynamicLossScaleState, grads_finite: jax.Array
    ) -> tuple[DynamicLossScaleState, jax.Array]:
        """Applies the update rule above, jitted, given whether this step's gradients are
        finite; `update` (inherited) takes the gradients themselves.

        Args:
          state: the current state, from `init` or a previous `update`.
          grads_finite: a bool scalar array, whether every floating gradient entry of
            this step is finite (on every device of the axis, where there is one).

        Returns:
          `(new_state, should_apply)`: `should_apply` is `grads_finite`.

        Examples:
          >>> import jax.numpy as jnp
          >>> import jax_lossscale as jls
          >>> ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=1)
          >>> state, should_apply = ls.adjust(ls.init(), jnp.array(True))
          >>> should_apply, ls(state)
          (Array(True, dtype=bool), Array(16., dtype=float32))
        """
        untraced = getattr(self, "_untraced", self)
        check_loss_scale_state(untraced, state)
        check_grads_finite(grads_finite, caller="DynamicLossScale.adjust")
        # jax.jit's wrapper returns Any.
        return cast(tuple[DynamicLossScaleState, jax.Array], _adjust(untraced, state, grads_finite))

    def _next_state(self, state: DynamicLossScaleState, finite: jax.Array) -> DynamicLossScaleState:
        """The update rule: the state after a step whose finiteness is `finite`."""
        full_tolerance = np.int32(self.hysteresis)
        # A state saved under other hyperparameters (a run resumed with changed settings)
        # obeys these from this update on.
        scale = jnp.fmin(  # NaN as min_loss_scale, as `init` takes it
            jnp.fmax(state.loss_scale, np.float32(self.min_loss_scale)), np.float32(self._ceiling)
        )
        good_steps = state.good_steps
        overflows_until_backoff = jnp.clip(state.overflows_until_backoff, 1, full_tolerance)

        good_steps_after_finite = good_steps + 1
        period_done = good_steps_after_finite >= np.int32(self.increment_period)
        grown = scale * np.float32(self.multiplier)
        can_grow = grown <= np.float32(self._ceiling)  # false for inf too
        scale_after_finite = jnp.where(period_done & can_grow, grown, scale)
        refill = period_done | self.consecutive_hysteresis
        tolerance_after_finite = jnp.where(refill, full_tolerance, overflows_until_backoff)
        good_steps_after_finite = jnp.where(period_done, np.int32(0), good_steps_after_finite)

        backs_off = overflows_until_backoff <= 1
        if self.backoff_factor is None:
            # The barrier keeps XLA from turning the division into a multiplication by the
            # rounded reciprocal, so jitted and eager updates agree bit for bit.
            reduced = scale / jax.lax.optimization_barrier(np.float32(self.multiplier))
        else:
            reduced = scale * np.float32(self.backoff_factor)
        reduced = jnp.maximum(reduced, np.float32(self.min_loss_scale))
        scale_after_overflow = jnp.where(backs_off, reduced, scale)
        tolerance_after_overflow = jnp.maximum(overflows_until_backoff - 1, np.int32(1))

        return DynamicLossScaleState(
            loss_scale=jnp.where(finite, scale_after_finite, scale_after_overflow),
            good_steps=jnp.where(finite, good_steps_after_finite, np.int32(0)),
            overflows_until_backoff=jnp.where(
                finite, tolerance_after_finite, tolerance_after_overflow
            ),
        )

    @property
    def _ceiling(self) -> float:
        return _checks.FLOAT32_MAX if self.max_loss_scale is None else self.max_loss_scale

    def get_config(self) -> dict[str, Any]:
        """Returns the hyperparameters as a JSON-able dict, which `from_config` takes back."""
        if isinstance(self.initial_loss_scale, jax.Array):
            raise TypeError(
                "DynamicLossScale.get_config: initial_loss_scale is traced, and a config holds "
                "numbers; build the loss scale with a number outside the traced function to "
                "serialize it"
            )
        return init_fields(self)


@functools.partial(jax.jit, static_argnums=0)
def _adjust(
    loss_scale: DynamicLossScale, state: DynamicLossScaleState, finite: jax.Array
) -> tuple[DynamicLossScaleState, jax.Array]:
    return loss_scale._next_state(state, finite), finite
