"""Spike skipping: when a finite step is a spike, and the windows of recent values it reads."""

import dataclasses
import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _checks
from jax_lossscale._axes import names_of, varying_axes
from jax_lossscale._checks import check_named_arrays, describe, describe_array, is_array
from jax_lossscale._counters import counted
from jax_lossscale._numerics import GradientSummary
from jax_lossscale._types import AxisName


class RecentValues(NamedTuple):
    """The last values of a signal (the gradient norm or the loss) on applied steps.

    A member of `SpikeWindows`, which a `LossScaledState` holds as `spike_windows`: the
    type to name when a checkpoint is restored into a template written by hand.

    Examples:
      >>> import optax
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(
      ...     optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0, spike_window=4
      ... )
      >>> windows = tx.init({"w": jnp.zeros(2)}).spike_windows
      >>> type(windows.recent_grad_norms) is jls.RecentValues, windows.recent_grad_norms.values
      (True, Array([0., 0., 0., 0.], dtype=float32))
    """

    values: jax.Array  # float32[spike_window]: a ring, the oldest value overwritten first
    filled: jax.Array  # int32: how many of `values` hold a value, up to spike_window
    next_index: jax.Array  # int32: where the next value goes


class SpikeWindows(NamedTuple):
    """The windows `loss_scaled(..., skip_spike_sigmas=...)` tests spikes against: the
    `spike_windows` of its `LossScaledState` (None without `skip_spike_sigmas`).

    Examples:
      >>> import optax
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), skip_spike_sigmas=3.0)
      >>> windows = tx.init({"w": jnp.zeros(2)}).spike_windows
      >>> isinstance(windows, jls.SpikeWindows), windows.spikes_in_a_row
      (True, Array(0, dtype=int32))
    """

    recent_grad_norms: RecentValues
    recent_losses: RecentValues  # filled only by steps given `value=`
    # int32: finite steps in a row above a full window (skipped, or applied to re-baseline)
    spikes_in_a_row: jax.Array


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    """`loss_scaled`'s spike options, checked: when a finite step is a spike.

    A finite step is a spike when its gradient norm is above `norm_above`, or, with
    `sigmas`, when its gradient norm (or the loss given as `value=`) is not finite, or
    the window of the last `window` applied steps is full and the value is above its
    mean plus `sigmas` standard deviations (the population's).

    The windows re-baseline: once `rebaseline_after` finite steps in a row were above
    them, the next ones above them are not spikes (they are applied, unless the bound or
    the loss scale skips them, and enter the windows) until a step is within them again.
    A lasting change of level (the norm moving from 1.0 to 1.5 for good) or a window of
    zeros followed by nonzero norms thus costs `rebaseline_after` skipped steps, never
    the run.
    """

    norm_above: float | None = None
    sigmas: float | None = None
    window: int = 128

    def __post_init__(self) -> None:
        owner = "loss_scaled"
        above = _checks.optional_positive_real(owner, "skip_grad_norm_above", self.norm_above)
        sigmas = _checks.optional_positive_real(owner, "skip_spike_sigmas", self.sigmas)
        window = _checks.integer(owner, "spike_window", self.window, minimum=2)
        object.__setattr__(self, "norm_above", above)
        object.__setattr__(self, "sigmas", sigmas)
        object.__setattr__(self, "window", window)

    @property
    def keeps_windows(self) -> bool:
        return self.sigmas is not None

    @property
    def rebaseline_after(self) -> int:
        """How many steps in a row above the windows are skipped before the windows follow
        the new level: a quarter of the window, at least 1."""
        return max(1, self.window // 4)

    def init(self) -> SpikeWindows | None:
        """Empty windows, or None when the rule reads none."""
        if not self.keeps_windows:
            return None

        def empty() -> RecentValues:
            return RecentValues(
                values=jnp.zeros([self.window], jnp.float32),
                filled=jnp.zeros([], jnp.int32),
                next_index=jnp.zeros([], jnp.int32),
            )

        return SpikeWindows(
            recent_grad_norms=empty(),
            recent_losses=empty(),
            spikes_in_a_row=jnp.zeros([], jnp.int32),
        )

    def loss(self, value: Any, axis_name: AxisName | None) -> jax.Array | None:
        """The `value=` extra argument as a float32 scalar, when the rule reads it: its mean
        over the devices of `axis_name`, so that they all test the same loss."""
        if value is None or not self.keeps_windows:
            return None
        if is_array(value):
            real = value.shape == () and (
                jnp.issubdtype(value.dtype, jnp.floating)
                or jnp.issubdtype(value.dtype, jnp.integer)
            )
        else:
            real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not real:
            raise TypeError(
                "loss_scaled.update: value must be the step's loss, a real scalar (a Python "
                f"number or an array of shape ()), got {describe(value)}"
            )
        loss = jnp.asarray(value).astype(jnp.float32)
        return loss if axis_name is None else _mean_over(loss, axis_name)

    def decide(
        self,
        summary: GradientSummary,
        loss: jax.Array | None,
        windows: SpikeWindows | None,
        scale_applies: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """`(spike, apply)`: whether the step is a spike, and whether it is applied.

        Without options the loss scale alone decides (XLA folds a FixedLossScale's constant).
        With one, a non-finite step, the largest spike there is, is skipped under every
        loss scale.
        """
        spike = self.is_spike(summary.norm, loss, windows)
        if spike is None:
            return jnp.array(False), scale_applies
        spike = spike & scale_applies & summary.finite
        return spike, scale_applies & summary.finite & ~spike

    def is_spike(
        self, grad_norm: jax.Array, loss: jax.Array | None, windows: SpikeWindows | None
    ) -> jax.Array | None:
        """Whether the step is a spike, or None when the rule has no test (no options set)."""
        spikes = []
        if self.norm_above is not None:
            spikes.append(grad_norm > np.float32(self.norm_above))
        if windows is not None:
            finite, above = self._window_test(windows, grad_norm, loss)
            rebaselining = windows.spikes_in_a_row >= self.rebaseline_after
            spikes.append(~finite | (above & ~rebaselining))
        return functools.reduce(jnp.logical_or, spikes) if spikes else None

    def _window_test(
        self, windows: SpikeWindows, grad_norm: jax.Array, loss: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]:
        """Whether the step's values are finite, and whether one is above its full window."""
        assert self.sigmas is not None  # windows are kept only with sigmas
        finite = jnp.isfinite(grad_norm)
        above = _above(grad_norm, windows.recent_grad_norms, self.sigmas)
        if loss is not None:
            finite &= jnp.isfinite(loss)
            above |= _above(loss, windows.recent_losses, self.sigmas)
        return finite, above

    def record(
        self,
        windows: SpikeWindows | None,
        grad_norm: jax.Array,
        loss: jax.Array | None,
        applied: jax.Array,
    ) -> SpikeWindows | None:
        """`windows` with this step's values written in, if it was applied, and the count
        of steps in a row above them moved on (kept by a step whose values are not finite)."""
        if windows is None:
            return None
        finite, above = self._window_test(windows, grad_norm, loss)
        count = windows.spikes_in_a_row
        count = jnp.where(above, counted(count, jnp.bool_(True)), 0)
        return SpikeWindows(
            recent_grad_norms=_recorded(windows.recent_grad_norms, grad_norm, applied),
            recent_losses=(
                windows.recent_losses
                if loss is None
                else _recorded(windows.recent_losses, loss, applied)
            ),
            spikes_in_a_row=jnp.where(finite, count, windows.spikes_in_a_row),
        )

    def check_windows(self, windows: Any, where: str) -> None:
        """Raises unless `windows` is what `init` makes: the state given back to `update`."""
        if not self.keeps_windows:
            if windows is not None:
                raise TypeError(
                    f"{where}: state.spike_windows holds spike windows, but this loss_scaled has "
                    "skip_spike_sigmas=None; pass the state returned by this transformation's "
                    "init()"
                )
            return
        if not isinstance(windows, SpikeWindows):
            raise TypeError(
                f"{where}: state.spike_windows must be the SpikeWindows that init() makes when "
                f"skip_spike_sigmas is set, got {describe(windows)}"
            )
        template = jax.eval_shape(self.init)
        for name in _WINDOW_FIELDS:
            window = getattr(windows, name)
            values: Any = getattr(window, "values", None)
            if getattr(values, "shape", (self.window,)) != (self.window,):
                raise ValueError(
                    f"{where}: state.spike_windows.{name}.values has shape {values.shape}, but "
                    f"this loss_scaled has spike_window={self.window}; pass the state returned "
                    "by this transformation's init()"
                )
            check_named_arrays(
                window,
                getattr(template, name),
                where=where,
                label=f"state.spike_windows.{name}",
                source="init()",
            )
        count: Any = windows.spikes_in_a_row
        if not (
            is_array(count)
            and count.dtype == jnp.int32
            and count.shape == ()
            and not getattr(count, "weak_type", False)
        ):
            raise TypeError(
                f"{where}: state.spike_windows.spikes_in_a_row must be an int32 scalar array "
                f"(not weakly typed), got {describe_array(count)}; pass the state returned by "
                "this transformation's init()"
            )


_WINDOW_FIELDS = ("recent_grad_norms", "recent_losses")  # the RecentValues fields of SpikeWindows


def _above(value: jax.Array, window: RecentValues, sigmas: float) -> jax.Array:
    """Whether `value` is above the mean of a full `window` plus `sigmas` standard
    deviations. (A value that is not finite is a spike by itself, and never enters a
    window, where it would make every later value a spike.)

    Computed in units of a power of two near the window's largest magnitude, exactly as in
    plain float32 where its squares neither underflow nor overflow: so a window of norms
    near 1e-18 or of losses near 1e22 decides as one near 1.0 does.
    """
    _, exponent = jnp.frexp(jnp.max(jnp.abs(window.values)))
    unit = jnp.ldexp(np.float32(1), jnp.clip(exponent - 1, -126, 127))
    values = window.values / unit
    mean = jnp.mean(values)
    std = jnp.sqrt(jnp.mean(jnp.square(values - mean)))
    full = window.filled >= window.values.shape[0]
    return full & (value / unit > mean + np.float32(sigmas) * std)


def _recorded(window: RecentValues, value: jax.Array, applied: jax.Array) -> RecentValues:
    """`window` with `value` written at its next index if the step was applied."""
    size = window.values.shape[0]
    values = jnp.asarray(window.values)  # a state read back with jax.device_get holds NumPy's
    return RecentValues(
        values=jnp.where(applied, values.at[window.next_index].set(value), values),
        filled=jnp.where(applied, jnp.minimum(window.filled + 1, size), window.filled),
        next_index=jnp.where(applied, (window.next_index + 1) % size, window.next_index),
    )


def _mean_over(value: jax.Array, axis_name: AxisName) -> jax.Array:
    """The mean of `value` over `axis_name`, the same on every device.

    Under `shard_map`, a value (a data-parallel loss) may vary over some of the axes only
    (over "data" of ("data", "model")); `psum` refuses such a mix, so the mean is taken over
    the axes it varies over, and it is already the same along the others. Where nothing
    says which axes it varies over (`pmap`, or `check_vma=False`), over all of them.
    """
    varying = varying_axes(value)
    axes = tuple(name for name in names_of(axis_name) if name in varying) or axis_name
    mean: jax.Array = jax.lax.pmean(value, axes)
    return mean
