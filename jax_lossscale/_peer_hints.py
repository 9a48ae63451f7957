"""Hints for users of jmp, mpx and flax: their names, keywords and attributes, and ours.

A keyword argument, attribute or module name that another loss-scaling library has and this
one does not gets an error that says what to write here instead.
"""

from typing import Any

from jax_lossscale._checks import describe

# Keyword arguments of other libraries' loss scales, and what to write here instead.
_PEER_KEYWORDS = {
    "DynamicLossScale": {
        "loss_scale": ("initial_loss_scale", "jmp's loss_scale"),
        "period": ("increment_period", "jmp's and mpx's period"),
        "factor": ("multiplier", "jmp's and mpx's factor"),
        "loss_scaling": ("initial_loss_scale", "mpx's loss_scaling"),
        "min_loss_scaling": ("min_loss_scale", "mpx's min_loss_scaling"),
        "scale": ("initial_loss_scale", "flax's scale"),
        "growth_interval": (
            "increment_period",
            "flax's growth_interval + 1 reproduces flax's, PyTorch's growth_interval",
        ),
        "growth_factor": ("multiplier", "flax's and PyTorch's growth_factor"),
        "minimum_scale": ("min_loss_scale", "flax's minimum_scale"),
        "init_scale": ("initial_loss_scale", "PyTorch's init_scale"),
        "initial_scale": ("initial_loss_scale", "Keras's initial_scale"),
        "dynamic_growth_steps": ("increment_period", "Keras's dynamic_growth_steps"),
    },
    "FixedLossScale": {
        "loss_scale": ("loss_scale_value", "jmp's StaticLossScale(loss_scale)"),
    },
}

_COUNTER = (
    "the count of finite steps lives in the state, not in the loss scale: resume it by "
    "setting the state's good_steps (docs/migrating.md, 'Resuming a jmp or flax checkpoint')"
)


def check_no_peer_keywords(owner: str, kwargs: dict[str, Any]) -> None:
    """Raises `TypeError` naming the argument to write for another library's keyword
    (jmp's `period=`, `factor=`, mpx's `loss_scaling=`, ...) given to `owner`."""
    known = _PEER_KEYWORDS.get(owner, {})
    for name, value in kwargs.items():
        if name in known:
            ours, theirs = known[name]
            raise TypeError(
                f"{owner}({name}={describe(value)}): {owner} takes no argument {name}; write "
                f"{ours}={describe(value)} ({theirs})"
            )
        if name == "counter" and known:
            raise TypeError(
                f"{owner}(counter={describe(value)}): {owner} takes no counter; " + _COUNTER
            )


# Attributes of other libraries' loss-scale objects, and where the value is here.
_CURRENT_SCALE = (
    "the current scale lives in the state, not in the loss scale: read it with "
    "jls.get_loss_scale(opt_state) under loss_scaled, or loss_scale(state); the scale it "
    "starts from is .{initial}"
)
_PEER_ATTRIBUTES = {
    "loss_scale": _CURRENT_SCALE,
    "loss_scaling": _CURRENT_SCALE,
    "counter": "the count of finite steps lives in the state: "
    "jls.get_loss_scale_stats(opt_state) and opt_state.loss_scale_state.good_steps",
    "period": "write .increment_period",
    "factor": "write .multiplier",
    "min_loss_scaling": "write .min_loss_scale",
    "adjust": "loss_scaled(optimizer, loss_scale).update unscales, checks and adjusts; alone, "
    "state, should_apply = loss_scale.update(state, grads) takes the unscaled gradients",
}


def peer_attribute_error(owner: Any, name: str) -> AttributeError:
    """The `AttributeError` for `owner.name`: for another library's attribute (jmp's
    `loss_scale.loss_scale`, `.counter`, ...) it says where the value is here."""
    message = f"{type(owner).__name__!r} object has no attribute {name!r}"
    if name not in _PEER_ATTRIBUTES:
        return AttributeError(message, name=name, obj=owner)  # Python's "Did you mean"
    initial = "loss_scale_value" if hasattr(owner, "loss_scale_value") else "initial_loss_scale"
    message += "; " + _PEER_ATTRIBUTES[name].format(initial=initial)
    return AttributeError(message, name=None, obj=None)  # no "Did you mean" max_loss_scale


def missing_tree_error(owner: str, method: str, what: str) -> TypeError:
    """The `TypeError` for jmp's `loss_scale.scale(loss)`: the state argument is missing."""
    return TypeError(
        f"{owner}.{method}(state, {what}) takes the loss scale's state first, the current one: "
        "opt_state.loss_scale_state under loss_scaled, since tx.update unscales by the current "
        "scale (loss_scale.init() holds the initial one). jmp's loss_scale.scale(loss) is "
        "loss * jls.get_loss_scale(opt_state), or jls.value_and_grad(loss_fn, opt_state); its "
        "loss_scale.unscale(grads) happens inside tx.update"
    )


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


def module_attribute_error(name: str) -> AttributeError:
    """The `AttributeError` for `jax_lossscale.name`: for a name of jmp's or mpx's API, it
    says what to write instead."""
    if name not in _PEER_NAMES:
        return AttributeError(f"module 'jax_lossscale' has no attribute {name!r}")
    peer, instead = _PEER_NAMES[name]
    return AttributeError(
        f"module 'jax_lossscale' has no attribute {name!r}, {peer}'s name: {instead} "
        "(docs/migrating.md)",
        name=None,  # no "Did you mean" a name of ours that is not the mapping
        obj=None,
    )
