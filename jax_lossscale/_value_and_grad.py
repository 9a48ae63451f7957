"""`value_and_grad`: the gradients of the loss times the scale, and the loss as it is."""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._checks import describe, is_array, is_at_least_float32, is_scalar_array
from jax_lossscale._fp8_meta import MetaLeaves, times_saturating
from jax_lossscale._lookup import get_loss_scale


def value_and_grad(
    fun: Callable[..., Any],
    opt_state: Any,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    using: Callable[..., Any] | None = None,
    fp8_meta: Any = None,
) -> Callable[..., Any]:
    """`jax.value_and_grad` of `fun`, with the gradients scaled for `loss_scaled`.

    The gradients are those of `fun`'s value times the scale, the product taken in
    float32 (a float16 loss times 2**15 would overflow), exactly whatever the value's
    dtype: for a float16 or bfloat16 loss, the backward pass of `fun` starts from the
    largest power of two in the scale that the loss dtype holds (at most 2**15 for
    float16), exact there, and the gradients are multiplied by the rest of the scale in
    float32 (a scale that is not a power of two, such as 2**15 * 0.7, is not rounded to
    the loss dtype).

    fp8 meta leaves (`loss_scaled`'s `fp8_meta`), whose "gradients" are their new values,
    come back as flax computes them, never multiplied by the rest. The output gradients'
    amax histories and scales hold amaxes of the gradients of the loss times the scale:
    the layers run with them divided by the rest (2 for a float16 loss at 2**16, whose
    backward pass carries 2**15; 1.5 at 1536, which carries 1024), and they come back
    multiplied by it, so that `loss_scaled` can follow the scale's every change.

    The scale is read from `opt_state` as `get_loss_scale` reads it (an optax state or
    a flax nnx `Optimizer`), or `opt_state` is the scale itself, a float32 scalar
    array. Build it inside the train step, with the step's own `opt_state`: one trace
    serves every step, whatever the scale. The scale is read when the function is
    called, so one built once from an nnx `Optimizer` (updated in place) follows its
    scale in an eager loop; one built outside a jitted step and called inside it
    would compile the first scale in as a constant, and raises instead.

    Args:
      fun: the loss function; its value (or the first element of its output, with
        `has_aux`) must be a real floating scalar array, or a Python float as
        `jax.value_and_grad` accepts.
      opt_state: the optax state holding a `LossScaledState`, or the scale.
      argnums: which positional arguments to differentiate, as `jax.value_and_grad`.
      has_aux: whether `fun` returns `(value, aux)`.
      using: the value-and-grad transformation, `jax.value_and_grad` by default;
        `eqx.filter_value_and_grad` or `nnx.value_and_grad` for those frameworks.
      fp8_meta: which leaves of the gradients are fp8 meta state, as `loss_scaled` takes
        it: None for those under flax's `"_overwrite_with_gradient"` collection.

    Returns:
      A function of `fun`'s arguments that returns `(value, grads)` (`((value, aux),
      grads)` with `has_aux`): `value` is `fun`'s own value, bit for bit, and `grads` are
      the gradients of `value * scale`, the scaled gradients that `loss_scaled(...).update`
      takes and unscales.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jax_lossscale as jls
      >>> tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(initial_loss_scale=8.0))
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> opt_state = tx.init(params)
      >>> loss, grads = jls.value_and_grad(lambda p: jnp.sum(p["w"] ** 2), opt_state)(params)
      >>> loss, grads["w"]
      (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """
    if not callable(fun):
        raise TypeError(f"value_and_grad(fun={describe(fun)}): fun must be callable")
    if using is not None and not callable(using):
        raise TypeError(
            f"value_and_grad(using={describe(using)}): using must be a value-and-grad "
            "transformation such as jax.value_and_grad or eqx.filter_value_and_grad"
        )
    meta_leaves = MetaLeaves(fp8_meta, caller="value_and_grad")
    given = _scale(opt_state) is opt_state  # the scale itself, not read from a state
    transform = jax.value_and_grad if using is None else using
    # eqx.filter_value_and_grad takes no argnums: it differentiates the first argument.
    options: dict[str, Any] = {"has_aux": True}
    if argnums != 0:
        options["argnums"] = argnums

    def value_and_scaled_grad(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # Read now: an nnx Optimizer updated in place since the function was built has a new one.
        scale = jnp.asarray(opt_state) if given else _scale(opt_state)
        if not isinstance(scale, jax.core.Tracer) and _staged():
            raise ValueError(
                f"value_and_grad: the loss scale ({float(scale)!r}) is a constant of the "
                "computation being traced, not one of its arguments: the opt_state it is read "
                "from did not go into that computation (grad_fn = value_and_grad(loss_fn, "
                "opt_state) built once outside a jitted step, or called in the body of a "
                "lax.scan or fori_loop that closes over opt_state), so the first scale would "
                "be compiled in and go stale after the scale changes. Pass opt_state in (an "
                "argument of the jitted step, or the loop's carry) and build it there: "
                "jls.value_and_grad(loss_fn, opt_state)(params, ...)"
            )

        # The output gradients' meta leaves, at the part of the scale the backward pass carries.
        numbers = argnums if using is None else 0
        args, meta_divided = _with_meta_divided_by_rest(
            fun, has_aux, scale, meta_leaves, numbers, args, kwargs
        )

        def scaled(*args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, Any, Any]]:
            output = fun(*args, **kwargs)
            if has_aux and not (isinstance(output, list | tuple) and len(output) == 2):
                # jax.value_and_grad's check and message; unpacked, a length-2 array would
                # give the gradient of its first element.
                raise TypeError(
                    "value_and_grad(has_aux=True): expected function with aux output to return "
                    f"a two-element tuple, but got type {type(output)} with value "
                    f"{describe(output)}"
                )
            value, aux = output if has_aux else (output, None)
            # A Python float is a float32 scalar to jax.value_and_grad, which accepts it.
            loss = jnp.asarray(value, jnp.float32) if type(value) is float else value
            if not (
                is_array(loss) and loss.shape == () and jnp.issubdtype(loss.dtype, jnp.floating)
            ):
                raise TypeError(
                    "value_and_grad: fun must return a real floating scalar"
                    f"{' as the first element of (value, aux)' if has_aux else ''}, got "
                    f"{describe(value)}"
                )
            if is_at_least_float32(loss.dtype):
                wide = jnp.promote_types(loss.dtype, jnp.float32)
                return loss.astype(wide) * scale.astype(wide), (value, aux, None)
            # The cotangent that enters fun's backward pass has the loss's dtype: the largest
            # power of two in the scale that the dtype holds is exact there; the rest of the
            # scale multiplies the gradients afterwards, in float32.
            power, rest = _split(scale, loss.dtype)
            return loss.astype(jnp.float32) * power, (value, aux, rest)

        (_, (value, aux, rest)), grads = transform(scaled, **options)(*args, **kwargs)
        if rest is not None:
            grads = _restored(meta_leaves, grads, rest, meta_divided)
        return ((value, aux) if has_aux else value), grads

    return value_and_scaled_grad


def _split(scale: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """`scale` as `power * rest`: `power` the largest power of two <= `scale` that `dtype`
    holds as a normal number, `rest` (>= 1 unless the scale is below dtype's normals) the
    quotient, exact in float32."""
    finfo = jnp.finfo(dtype)
    _, exponent = jnp.frexp(scale)  # scale = m * 2**exponent with m in [0.5, 1)
    exponent = jnp.clip(exponent - 1, finfo.minexp, finfo.maxexp - 1)
    power = jnp.ldexp(jnp.float32(1.0), exponent)
    return power, scale / power


def _times(rest: jax.Array, leaf: Any) -> Any:
    """A floating or complex gradient leaf times `rest`, computed in float32 (or wider), in
    its dtype."""
    if is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact):
        wide = jnp.promote_types(leaf.dtype, jnp.float32)
        return (leaf.astype(wide) * rest.astype(wide)).astype(leaf.dtype)
    return leaf


def _with_meta_divided_by_rest(
    fun: Callable[..., Any],
    has_aux: bool,
    scale: jax.Array,
    meta_leaves: MetaLeaves,
    argnums: int | Sequence[int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], bool]:
    """`args` with the differentiated arguments' output-gradient meta leaves divided by the
    rest of the scale, and True; or `args` as they are and False where there is nothing to
    divide (or argnums is wrong: jax's own error follows)."""
    numbers = [argnums] if isinstance(argnums, int) else argnums
    if not isinstance(numbers, Sequence) or not all(
        isinstance(number, int) and -len(args) <= number < len(args) for number in numbers
    ):
        return args, False
    positions = [number % len(args) for number in numbers]
    differentiated = [args[position] for position in positions]
    # The differentiated arguments as the gradients come: one tree, or a tuple of them.
    tree = differentiated[0] if isinstance(argnums, int) else tuple(differentiated)
    rest = _rest_for_meta(fun, has_aux, scale, meta_leaves, tree, args, kwargs)
    if rest is None:
        return args, False
    lowered = _lowered(meta_leaves, tree, rest)
    lowered_args = list(args)
    for position, argument in zip(
        positions, [lowered] if isinstance(argnums, int) else lowered, strict=True
    ):
        lowered_args[position] = argument
    return tuple(lowered_args), True


def _rest_for_meta(
    fun: Callable[..., Any],
    has_aux: bool,
    scale: jax.Array,
    meta_leaves: MetaLeaves,
    tree: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> jax.Array | None:
    """The rest of the scale, the part the loss dtype does not carry, where the
    differentiated arguments hold output-gradient meta leaves and the loss (found by tracing
    `fun`, not running it) is narrower than float32; else None."""
    _, follows = meta_leaves.following(tree, "gradients", "value_and_grad")
    if not any(follows):
        return None
    output = jax.eval_shape(lambda: fun(*args, **kwargs))
    value = output[0] if has_aux and isinstance(output, list | tuple) else output
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or is_at_least_float32(dtype):
        return None
    _, rest = _split(scale, dtype)
    return rest


@jax.custom_vjp
def _divided(leaf: jax.Array, rest: jax.Array) -> jax.Array:
    """`leaf / rest`, whose cotangent goes through unchanged: a meta leaf's cotangent is its
    new value, at the scale the layer ran with."""
    return (leaf.astype(jnp.float32) / rest).astype(leaf.dtype)


def _divided_fwd(leaf: jax.Array, rest: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _divided(leaf, rest), rest


def _divided_bwd(rest: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cotangent, jnp.zeros_like(rest)


_divided.defvjp(_divided_fwd, _divided_bwd)


def _lowered(meta_leaves: MetaLeaves, tree: Any, rest: jax.Array) -> Any:
    """The differentiated arguments with their output-gradient meta leaves divided by `rest`."""
    _, follows = meta_leaves.following(tree, "gradients", "value_and_grad")
    leaves, structure = jax.tree.flatten(tree)
    lowered = [
        _divided(leaf, rest) if flag and jnp.issubdtype(leaf.dtype, jnp.floating) else leaf
        for leaf, flag in zip(leaves, follows, strict=True)
    ]
    return jax.tree.unflatten(structure, lowered)


def _restored(meta_leaves: MetaLeaves, grads: Any, rest: jax.Array, meta_divided: bool) -> Any:
    """The gradients times `rest`; the meta leaves as the layers gave them, the output
    gradients' times `rest` too (saturating) where they ran divided by it."""
    flags, follows = meta_leaves.following(grads, "gradients", "value_and_grad")
    leaves, structure = jax.tree.flatten(grads)
    restored = []
    for leaf, flag, follow in zip(leaves, flags, follows, strict=True):
        if follow and meta_divided and jnp.issubdtype(leaf.dtype, jnp.floating):
            restored.append(times_saturating(leaf, rest))
        elif not flag:
            restored.append(_times(rest, leaf))
        else:
            restored.append(leaf)
    return jax.tree.unflatten(structure, restored)


def _staged() -> bool:
    """Whether a jitted (or pmapped, scanned...) function is being traced here: there,
    new arrays are tracers. The probe's op is unused, and dropped from the graph."""
    return isinstance(jnp.zeros((), jnp.bool_), jax.core.Tracer)


def _scale(opt_state: Any) -> Any:
    """The scale: `opt_state` itself when it is one, else the one read from it."""
    if is_scalar_array(opt_state, np.float32):
        return opt_state
    if is_array(opt_state) or isinstance(opt_state, int | float):
        raise TypeError(
            f"value_and_grad(opt_state={describe(opt_state)}): a scale given directly must be "
            "a float32 scalar array"
            + (f", such as jnp.float32({opt_state!r})" if not is_array(opt_state) else "")
        )
    try:
        scale = get_loss_scale(opt_state)
    except LookupError as error:
        raise LookupError(
            f"value_and_grad: {error}; or pass the scale itself, a float32 scalar array"
        ) from None
    if jnp.shape(scale) != ():
        raise ValueError(
            f"value_and_grad: the loss scale in opt_state has shape {jnp.shape(scale)}, not (): "
            "a state replicated by pmap or stacked by vmap; call value_and_grad inside the "
            "pmapped (or vmapped) step, with the step's own opt_state, where the scale is a scalar"
        )
    return scale
