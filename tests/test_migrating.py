"""Migrating (docs/migrating.md): every jmp name mapped and run beside jmp 0.0.4, jmp's loss
scales with and without skipping fed a NaN and an inf batch, flax's `DynamicScale` step beside
the `loss_scaled` step that replaces it, and runs checkpointed by jmp or flax resumed inside a
`LossScaledState`.

"Step for step" below means the scale after every step and the decision to skip are equal;
params are compared to rounding (rtol 1e-6): the peers unscale by a multiplication or a
division of their own, which XLA fuses differently, so the last bit of an update may differ.
"""

import copy
import dataclasses
import functools
import pickle

import chex
import jax
import jax.numpy as jnp
import jmp
import mpx
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training.dynamic_scale import DynamicScale

import jax_lossscale as jls

from helpers import assert_bits_equal

F32_TINY = float(np.finfo(np.float32).tiny)

# --- jmp's casting names: an import swap ------------------------------------------------------


def jmp_users_casting_code(mp):
    """Code written against jmp, run with `mp` as the module: every casting name jmp has."""
    policy = mp.get_policy("params=float32,compute=half,output=float32")
    params = {"w": jnp.full((2, 3), 1.5, jnp.float32), "step": jnp.int32(7)}
    compute_params = policy.cast_to_compute(params)
    output = policy.cast_to_output(compute_params["w"] * 3)
    short = mp.get_policy("p=f32,c=bf16")
    explicit = mp.Policy(jnp.float32, jnp.float16, jnp.float16)
    finite = {"a": jnp.ones(2), "b": jnp.ones(3, jnp.float16)}
    return {
        "dtypes": [
            (np.dtype(p.param_dtype), np.dtype(p.compute_dtype), np.dtype(p.output_dtype))
            for p in (policy, short, explicit, policy.with_output_dtype(jnp.bfloat16))
        ],
        "compute_params": compute_params,
        "params_back": policy.cast_to_param(compute_params),
        "output": output,
        "full": mp.cast_to_full({"h": jnp.full(2, 0.1, jnp.float16), "i": jnp.arange(2)}),
        "half": mp.cast_to_half({"f": jnp.full(2, 0.1), "i": jnp.arange(2)}),
        "half_dtype": np.dtype(mp.half_dtype()),
        "all_finite": [
            mp.all_finite(finite),
            mp.all_finite({**finite, "c": jnp.array([1.0, jnp.inf])}),
            mp.all_finite({**finite, "c": jnp.array([jnp.nan], jnp.float16)}),
            mp.all_finite({}),
            mp.all_finite({**finite, "learning_rate": 1e-3, "step": 7, "done": False}),
            mp.all_finite({**finite, "g": float("inf")}),
        ],
        # The dtypes are JAX's scalar types: called to make a scalar, and keys of a dict.
        "compute_scalar": policy.compute_dtype(1e-3),
        "dtype_names": [
            {jnp.float16: "fp16", jnp.bfloat16: "bf16", jnp.float32: "fp32"}[dtype]
            for dtype in (policy.param_dtype, policy.compute_dtype, short.compute_dtype)
        ],
        "scalar_types": (policy.compute_dtype is jnp.float16, short.param_dtype is jnp.float32),
        # NumPy scalars (a logged learning rate, a temperature) are left as they are.
        "numpy_scalars": mp.cast_to_half({"lr": np.float64(1e-5), "temperature": np.float32(0.7)}),
    }


def test_jmps_casting_code_runs_unchanged_with_jax_lossscale_as_jmp():
    """`import jax_lossscale as jmp`: jmp's `Policy`, `get_policy` (long and short keys,
    `half`), `cast_to_param/compute/output`, `with_output_dtype`, `cast_to_full`,
    `cast_to_half`, `half_dtype` and `all_finite` give jmp's results, dtypes and bits."""
    ours, theirs = jmp_users_casting_code(jls), jmp_users_casting_code(jmp)
    assert ours["dtypes"] == theirs["dtypes"]
    assert ours["dtypes"][0] == (np.dtype("float32"), np.dtype("float16"), np.dtype("float32"))
    assert ours["half_dtype"] == theirs["half_dtype"] == np.dtype("float16")
    for key in ("compute_params", "params_back", "output", "full", "half"):
        chex.assert_trees_all_equal_dtypes(ours[key], theirs[key])
        assert_bits_equal(ours[key], theirs[key])
    assert [bool(x) for x in ours["all_finite"]] == [True, False, False, True, True, False]
    assert [bool(x) for x in theirs["all_finite"]] == [True, False, False, True, True, False]
    assert_bits_equal(ours["compute_scalar"], theirs["compute_scalar"])
    assert ours["dtype_names"] == theirs["dtype_names"] == ["fp32", "fp16", "bf16"]
    assert ours["scalar_types"] == theirs["scalar_types"] == (True, True)
    for numpy_scalars in (ours["numpy_scalars"], theirs["numpy_scalars"]):
        assert numpy_scalars == {"lr": np.float64(1e-5), "temperature": np.float32(0.7)}
        assert [type(v) for v in numpy_scalars.values()] == [np.float64, np.float32]


def test_each_library_parses_the_others_policy_string():
    """jmp writes full precision as "full", jax_lossscale as "f32"; each `get_policy` reads
    the other's `str(policy)` back to the same dtypes."""
    for spec in ("p=f32,c=f16,o=f32", "params=float32,compute=bfloat16", "half"):
        ours, theirs = jls.get_policy(spec), jmp.get_policy(spec)
        assert jls.get_policy(str(theirs)) == ours
        back = jmp.get_policy(str(ours))
        assert (back.param_dtype, back.compute_dtype, back.output_dtype) == (
            theirs.param_dtype,
            theirs.compute_dtype,
            theirs.output_dtype,
        )


# --- jmp's habits after `import jax_lossscale as jmp`: errors that say what to write ---------

JMP_NAMES_MISSING_HERE = {
    "NoOpLossScale": "module 'jax_lossscale' has no attribute 'NoOpLossScale', jmp's name: a step "
    "that selects on all_finite is DynamicLossScale(initial_loss_scale=1.0, max_loss_scale=1.0) "
    "(scale 1, non-finite steps skipped); a step that applies every step is FixedLossScale(1.0); "
    "either goes into loss_scaled(optimizer, loss_scale) (docs/migrating.md)",
    "StaticLossScale": "module 'jax_lossscale' has no attribute 'StaticLossScale', jmp's name: "
    "StaticLossScale(v) is DynamicLossScale(initial_loss_scale=v, min_loss_scale=v, "
    "max_loss_scale=v) where the step selects on all_finite (non-finite steps skipped), "
    "FixedLossScale(v) where every step is applied; either goes into loss_scaled(optimizer, "
    "loss_scale) (docs/migrating.md)",
    "select_tree": "module 'jax_lossscale' has no attribute 'select_tree', jmp's name: tx = "
    "loss_scaled(optimizer, loss_scale) skips a non-finite step in tx.update (its updates are "
    "-0.0, the optimizer state is kept); other state, such as a model's BatchNorm statistics, "
    "is where_applied(opt_state, new_state, state) after tx.update (docs/migrating.md)",
}


@pytest.mark.parametrize("name", [*JMP_NAMES_MISSING_HERE, "DynamicLossScaling", "nope"])
def test_a_jmp_or_mpx_name_missing_here_says_what_to_write_and_stays_out_of_the_api(name):
    swapped = jls  # `import jax_lossscale as jmp`, the import swap of the migration page
    with pytest.raises(AttributeError) as excinfo:
        getattr(swapped, name)
    message = str(excinfo.value)
    if name in JMP_NAMES_MISSING_HERE:
        assert message == JMP_NAMES_MISSING_HERE[name]
    elif name == "DynamicLossScaling":
        assert message.startswith(
            "module 'jax_lossscale' has no attribute 'DynamicLossScaling', mpx's name: "
            "DynamicLossScale(initial_loss_scale=loss_scaling, increment_period=period, "
        )
    else:
        assert message == "module 'jax_lossscale' has no attribute 'nope'"
    # Python adds "Did you mean: 'LossScale'?" to an error with a name, for a name of jmp's
    # only, where the message says what to write.
    assert (excinfo.value.name is None) == (name != "nope")
    assert not hasattr(swapped, name)
    assert name not in swapped.__all__
    assert name not in dir(swapped)
    peer = {"DynamicLossScaling": mpx, "nope": None}.get(name, jmp)
    assert peer is None or hasattr(peer, name)  # a name of the peer's own
    namespace = {}
    exec("from jax_lossscale import *", namespace)
    assert name not in namespace


STATE_FIRST = (
    "takes the loss scale's state first, the current one: opt_state.loss_scale_state under "
    "loss_scaled, since tx.update unscales by the current scale (loss_scale.init() holds the "
    "initial one). jmp's loss_scale.scale(loss) is loss * jls.get_loss_scale(opt_state), or "
    "jls.value_and_grad(loss_fn, opt_state); its loss_scale.unscale(grads) happens inside "
    "tx.update"
)
CURRENT_SCALE = (
    "the current scale lives in the state, not in the loss scale: read it with "
    "jls.get_loss_scale(opt_state) under loss_scaled, or loss_scale(state); the scale it "
    "starts from is "
)
JMP_HABITS = {
    "ls.scale(loss)": (
        lambda ls: ls.scale(jnp.float32(2.0)),
        TypeError,
        "DynamicLossScale.scale(state, tree) " + STATE_FIRST,
    ),
    "ls.unscale(grads)": (
        lambda ls: ls.unscale({"w": jnp.ones(2)}),
        TypeError,
        "DynamicLossScale.unscale(state, grads) " + STATE_FIRST,
    ),
    "ls.loss_scale": (
        lambda ls: ls.loss_scale,
        AttributeError,
        "'DynamicLossScale' object has no attribute 'loss_scale'; "
        + CURRENT_SCALE
        + ".initial_loss_scale",
    ),
    "ls.counter": (
        lambda ls: ls.counter,
        AttributeError,
        "'DynamicLossScale' object has no attribute 'counter'; the count of finite steps lives "
        "in the state: jls.get_loss_scale_stats(opt_state) and "
        "opt_state.loss_scale_state.good_steps",
    ),
    "ls.period": (
        lambda ls: ls.period,
        AttributeError,
        "'DynamicLossScale' object has no attribute 'period'; write .increment_period",
    ),
    "period=": (
        lambda ls: jls.DynamicLossScale(jnp.float32(2.0**15), period=2000),
        TypeError,
        "DynamicLossScale(period=2000): DynamicLossScale takes no argument period; write "
        "increment_period=2000 (jmp's and mpx's period)",
    ),
    "factor=": (
        lambda ls: jls.DynamicLossScale(factor=2),
        TypeError,
        "DynamicLossScale(factor=2): DynamicLossScale takes no argument factor; write "
        "multiplier=2 (jmp's and mpx's factor)",
    ),
    "FixedLossScale(loss_scale=)": (
        lambda ls: jls.FixedLossScale(loss_scale=128.0),
        TypeError,
        "FixedLossScale(loss_scale=128.0): FixedLossScale takes no argument loss_scale; write "
        "loss_scale_value=128.0 (jmp's StaticLossScale(loss_scale))",
    ),
    "FixedLossScale.loss_scale": (
        lambda ls: jls.FixedLossScale(128.0).loss_scale,
        AttributeError,
        "'FixedLossScale' object has no attribute 'loss_scale'; "
        + CURRENT_SCALE
        + ".loss_scale_value",
    ),
}


@pytest.mark.parametrize("habit", JMP_HABITS)
def test_a_jmp_habit_on_a_loss_scale_gets_an_error_naming_what_to_write(habit):
    call, error, message = JMP_HABITS[habit]
    with pytest.raises(error) as excinfo:
        call(jls.DynamicLossScale())
    assert str(excinfo.value) == message
    if error is AttributeError:
        assert excinfo.value.name is None  # no "Did you mean: 'max_loss_scale'?"


def test_jmp_habit_checks_leave_subclasses_and_copies_alone():
    """A user's subclass may have a `period` field; copies and `dataclasses.replace` work."""

    @dataclasses.dataclass(frozen=True)
    class Periodic(jls.FixedLossScale):
        period: int = 1

    assert Periodic(4.0, period=3).period == 3
    ls = jls.DynamicLossScale(increment_period=3)
    assert copy.deepcopy(ls) == ls
    assert pickle.loads(pickle.dumps(ls)) == ls
    assert dataclasses.replace(ls, multiplier=4.0).multiplier == 4.0
    with pytest.raises(AttributeError, match=r"^'DynamicLossScale' object has no attribute 'x'$"):
        _ = ls.x


def test_ls_scale_takes_the_current_state_from_opt_state_not_a_fresh_init():
    """The row for jmp's `loss_scale.scale(loss)`: `ls.scale(state, loss)` with the state from
    `opt_state` gives the true step; with `ls.init()`, after one back-off, the loss is scaled by
    2**15 while `tx.update` unscales by 2**14: every update is twice too large."""
    ls = jls.DynamicLossScale(2.0**15)
    tx = jls.loss_scaled(optax.sgd(1.0), ls)
    params = {"w": jnp.ones(2)}
    _, opt_state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)
    assert float(jls.get_loss_scale(opt_state)) == 2.0**14

    def scaled_grads(state):
        return jax.grad(lambda p: ls.scale(state, jnp.sum(p["w"])))(params)

    current, _ = tx.update(scaled_grads(opt_state.loss_scale_state), opt_state, params)
    fresh, _ = tx.update(scaled_grads(ls.init()), opt_state, params)
    np.testing.assert_array_equal(current["w"], [-1.0, -1.0])
    np.testing.assert_array_equal(fresh["w"], [-2.0, -2.0])


def test_a_jls_policy_does_what_haikus_set_policy_asks_of_a_jmp_policy():
    """`hk.mixed_precision.set_policy(cls, policy)` reads
    `policy.param_dtype` to create parameters, and calls `policy.cast_to_compute` on a module's
    `(args, kwargs)` and on each parameter it reads, and `policy.cast_to_output` on its output.
    A jls `Policy` answers each as jmp's does: same dtypes, same values."""
    spec = "params=float32,compute=float16,output=float32"
    ours, theirs = jls.get_policy(spec), jmp.get_policy(spec)
    assert ours.param_dtype == theirs.param_dtype == jnp.float32
    args_kwargs = (
        (jnp.full((2, 3), 1.5), np.full(2, 0.25), jnp.arange(3)),
        {"is_training": True, "rate": 0.1, "mask": jnp.ones(2, jnp.bool_)},
    )
    parameter = jnp.full((3,), 2.5, jnp.float32)
    output = {"logits": jnp.full((2,), 3.5, jnp.float16), "state": jnp.int32(4)}
    for cast, tree in [
        ("cast_to_compute", args_kwargs),
        ("cast_to_compute", parameter),
        ("cast_to_output", output),
    ]:
        got, want = getattr(ours, cast)(tree), getattr(theirs, cast)(tree)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert type(a) is type(b) or isinstance(a, jax.Array | np.generic), (a, b)
            assert np.asarray(a).dtype == np.asarray(b).dtype, (cast, a, b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ours.cast_to_compute(parameter).dtype == jnp.float16
    assert ours.cast_to_output(output)["logits"].dtype == jnp.float32


def test_haikus_set_policy_takes_a_jls_policy():
    """`hk.mixed_precision.set_policy` with a jls `Policy`: float32 params, a float16 matmul
    inside, a float32 output, and the values of the same module under jmp's policy."""
    import haiku as hk

    spec = "params=float32,compute=float16,output=float32"
    x = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
    results = []
    for policy in (jls.get_policy(spec), jmp.get_policy(spec)):

        def forward(x):
            return hk.Linear(4)(x)

        hk.mixed_precision.set_policy(hk.Linear, policy)
        try:
            model = hk.transform(forward)
            params = model.init(jax.random.key(0), x)
            out = model.apply(params, None, x)
            jaxpr = jax.make_jaxpr(model.apply)(params, None, x)
        finally:
            hk.mixed_precision.clear_policy(hk.Linear)
        assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
        assert out.dtype == jnp.float32
        (dot,) = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
        assert [v.aval.dtype for v in dot.invars] == [jnp.float16, jnp.float16]
        results.append(out)
    np.testing.assert_array_equal(results[0], results[1])


# --- jmp's loss scales --------------------------------------------------------------------------


def loss(params, x):
    return jnp.sum(params["w"] * x) + 0.5 * jnp.sum(params["w"] ** 2)


X_FINITE = jnp.array([0.5, -1.0, 2.0])
X_NAN = jnp.array([0.5, jnp.nan, 2.0])
X_INF = jnp.array([jnp.inf, -1.0, 2.0])
BATCHES = (X_FINITE, X_FINITE, X_NAN, X_FINITE, X_INF, X_FINITE, X_FINITE, X_FINITE)
PARAMS = {"w": jnp.array([1.0, -2.0, 0.25])}


def jmp_run(inner, loss_scale, skip, batches=BATCHES, params=PARAMS, opt_state=None):
    """jmp's train step as its README and the haiku ImageNet example write it, eagerly (a jmp
    loss scale cannot be a jit argument on current JAX): `(params, scale, skipped)` per step,
    and the final `(params, opt_state, loss_scale)`. As in the haiku example, a step that does
    not skip does not adjust the scale either (`--mp_skip_nonfinite` guards both)."""
    opt_state = inner.init(params) if opt_state is None else opt_state
    trace = []
    for x in batches:
        grads = jax.grad(lambda p, x=x, ls=loss_scale: ls.scale(loss(p, x)))(params)
        grads = loss_scale.unscale(grads)
        grads_finite = jmp.all_finite(grads)
        if skip:
            loss_scale = loss_scale.adjust(grads_finite)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if skip:
            params, opt_state = jmp.select_tree(
                grads_finite, (new_params, new_opt_state), (params, opt_state)
            )
        else:
            params, opt_state = new_params, new_opt_state
        trace.append((params, float(loss_scale.loss_scale), not bool(grads_finite) and skip))
    return trace, (params, opt_state, loss_scale)


def jls_run(inner, loss_scale, batches=BATCHES):
    """The same run through `loss_scaled`, jitted with params and state donated. A function
    for `loss_scale` is called inside the jitted init and step, as a jmp train state builds
    its scale there."""

    def make_tx():
        built = loss_scale if isinstance(loss_scale, jls.LossScale) else loss_scale()
        return jls.loss_scaled(inner, built)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x):
        grads = jax.grad(lambda p: loss(p, x) * jls.get_loss_scale(opt_state))(params)
        updates, opt_state = make_tx().update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    init = jax.jit(lambda params: make_tx().init(params))
    params, opt_state, trace = jax.tree.map(jnp.copy, PARAMS), init(PARAMS), []
    for x in batches:
        params, opt_state = train_step(params, opt_state, x)
        stats = jls.get_loss_scale_stats(opt_state)
        kept = jax.tree.map(np.array, params)  # the next step donates `params`
        trace.append((kept, float(stats.loss_scale), not bool(stats.last_step_applied)))
    return trace


def assert_runs_agree(ours, theirs):
    assert [t[1:] for t in ours] == [t[1:] for t in theirs]  # scales and skips, step for step
    for (our_params, *_), (their_params, *_) in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(our_params["w"], their_params["w"], rtol=1e-6)


INNERS = {
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(0.1),
}

# jmp's loss scale, whether the step selects on `all_finite`, and the jax_lossscale loss scale
# that behaves the same, as the table in docs/migrating.md maps them.
JMP_MAPPINGS = {
    "DynamicLossScale": (
        lambda: jmp.DynamicLossScale(jnp.float32(2.0**15), period=2, factor=2),
        True,
        lambda: jls.DynamicLossScale(
            initial_loss_scale=2.0**15, increment_period=2, multiplier=2.0
        ),
    ),
    "DynamicLossScale, never adjusted": (
        lambda: jmp.DynamicLossScale(jnp.float32(2.0**15), period=2, factor=2),
        False,
        lambda: jls.FixedLossScale(2.0**15),
    ),
    "StaticLossScale, skipping": (
        lambda: jmp.StaticLossScale(jnp.float32(2.0**8)),
        True,
        lambda: jls.DynamicLossScale(2.0**8, min_loss_scale=2.0**8, max_loss_scale=2.0**8),
    ),
    "StaticLossScale": (
        lambda: jmp.StaticLossScale(jnp.float32(2.0**8)),
        False,
        lambda: jls.FixedLossScale(2.0**8),
    ),
    "NoOpLossScale, skipping": (
        lambda: jmp.NoOpLossScale(),
        True,
        lambda: jls.DynamicLossScale(initial_loss_scale=1.0, max_loss_scale=1.0),
    ),
    "NoOpLossScale": (lambda: jmp.NoOpLossScale(), False, lambda: jls.FixedLossScale(1.0)),
}

# Scales after each step of BATCHES (finite, finite, NaN, finite, inf, finite x 3).
EXPECTED_SCALES = {
    "DynamicLossScale": [2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15],
    "DynamicLossScale, never adjusted": [2.0**15] * 8,
    "StaticLossScale, skipping": [2.0**8] * 8,
    "StaticLossScale": [2.0**8] * 8,
    "NoOpLossScale, skipping": [1.0] * 8,
    "NoOpLossScale": [1.0] * 8,
}


@pytest.mark.parametrize("inner_name", INNERS)
@pytest.mark.parametrize("mapping", JMP_MAPPINGS)
def test_each_jmp_loss_scale_maps_to_one_that_skips_and_scales_the_same(mapping, inner_name):
    """Through a NaN and an inf batch: the mapped loss scale skips exactly the steps jmp's
    step skips (none where jmp applies every step), with the same scale after every step; with
    skipping the params after the NaN batch are those before it, bit for bit; without, the NaN
    reaches the params in both."""
    make_jmp, skip, make_jls = JMP_MAPPINGS[mapping]
    theirs, _ = jmp_run(INNERS[inner_name](), make_jmp(), skip)
    ours = jls_run(INNERS[inner_name](), make_jls())
    assert [scale for _, scale, _ in ours] == EXPECTED_SCALES[mapping]
    if skip:
        assert [skipped for *_, skipped in ours] == [False, False, True, False, True] + [False] * 3
        assert_runs_agree(ours, theirs)
        assert_bits_equal(ours[2][0], ours[1][0])
        assert_bits_equal(ours[4][0], ours[3][0])
    else:
        assert not any(skipped for *_, skipped in ours)
        assert [t[1:] for t in ours] == [t[1:] for t in theirs]
        for (our_params, *_), (their_params, *_) in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(our_params["w"], their_params["w"], rtol=1e-6)
        np.testing.assert_array_equal(np.isnan(ours[-1][0]["w"]), [True, True, False])


def test_jmps_unchanged_train_step_reads_the_scale_of_a_noop_mapping():
    """A train step that multiplies the loss by `jls.get_loss_scale(opt_state)` keeps working
    when the run drops loss scaling: `FixedLossScale(1.0)` gives it 1.0 (no wrapper at all would
    make `get_loss_scale` raise)."""
    tx = jls.loss_scaled(optax.sgd(0.1), jls.FixedLossScale(1.0))
    assert float(jls.get_loss_scale(tx.init(PARAMS))) == 1.0
    with pytest.raises(LookupError, match="holds no LossScaledState"):
        jls.get_loss_scale(optax.sgd(0.1).init(PARAMS))


def test_jmps_select_tree_over_model_state_is_where_applied():
    """The haiku ImageNet example's `jmp.select_tree(grads_finite, new_state, state)` over its
    BatchNorm statistics: `jls.where_applied(opt_state, new_state, state)` after `tx.update`
    selects the same, bit for bit, and an inf batch leaves the statistics as they were."""
    tx = jls.loss_scaled(optax.sgd(0.1, momentum=0.9), jls.DynamicLossScale())

    @jax.jit
    def train_step(params, state, opt_state, x):
        def loss_and_state(p):
            batch_mean = jnp.mean(p["w"] * x)
            new_state = {
                "mean": 0.9 * state["mean"] + 0.1 * batch_mean,
                "count": state["count"] + 1,
            }
            return loss(p, x) * jls.get_loss_scale(opt_state), new_state

        grads, new_state = jax.grad(loss_and_state, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        selected = jls.where_applied(opt_state, new_state, state)
        finite = jmp.all_finite(grads)
        return optax.apply_updates(params, updates), selected, opt_state, finite, new_state

    params, opt_state = PARAMS, tx.init(PARAMS)
    state = {"mean": jnp.float32(0.0), "count": jnp.int32(0)}
    for x in (X_FINITE, X_INF, X_FINITE):
        before = state
        params, state, opt_state, finite, new_state = train_step(params, state, opt_state, x)
        assert_bits_equal(state, jmp.select_tree(finite, new_state, before))
        if x is X_INF:
            assert not np.isfinite(new_state["mean"])
            assert_bits_equal(state, before)
    assert int(state["count"]) == 2


def test_jmps_docstring_scale_written_as_an_array_maps_as_it_is():
    """jmp's docstring builds its scale as `jnp.asarray(2.**15)`; the mapped loss scale takes
    the array as the number it holds and runs as jmp's, step for step."""
    loss_scale = jnp.asarray(2.0**15)
    theirs, _ = jmp_run(optax.adam(0.1), jmp.DynamicLossScale(loss_scale, period=2), True)
    ours = jls_run(
        optax.adam(0.1), jls.DynamicLossScale(initial_loss_scale=loss_scale, increment_period=2)
    )
    assert [scale for _, scale, _ in ours] == EXPECTED_SCALES["DynamicLossScale"]
    assert_runs_agree(ours, theirs)


def test_jmps_readme_float16_scale_built_inside_jit_maps_to_jmps_float32_one():
    """jmp's README builds its scale as `jmp.half_dtype()(2 ** 15)`, a float16 scalar, which
    jmp's own `adjust` refuses; the mapped loss scale, built inside the jitted init and step
    from that scalar (traced there), holds it in float32 and runs as jmp's float32 scale does,
    step for step (docs/migrating.md, "jmp habits inside a traced function")."""
    readme_scale = jmp.DynamicLossScale(jmp.half_dtype()(2**15), period=2)
    with pytest.raises(TypeError, match=r"lax\.select requires arguments to have the same dtypes"):
        readme_scale.adjust(jnp.array(True))
    float32_scale = jmp.DynamicLossScale(jnp.float32(2**15), period=2)
    theirs, _ = jmp_run(optax.adam(0.1), float32_scale, True)

    def built_inside():
        scale = jmp.half_dtype()(2**15)
        assert isinstance(scale, jax.core.Tracer)
        return jls.DynamicLossScale(initial_loss_scale=scale, increment_period=2)

    ours = jls_run(optax.adam(0.1), built_inside)
    assert [scale for _, scale, _ in ours] == EXPECTED_SCALES["DynamicLossScale"]
    assert_runs_agree(ours, theirs)


# --- mpx's DynamicLossScaling -----------------------------------------------------------------


def test_mpxs_readme_set_up_maps_to_a_scale_that_moves_and_skips_as_mpxs():
    """mpx's README builds its scale as `DynamicLossScaling(loss_scaling=mpx.FLOAT16_MAX,
    min_loss_scaling=jnp.ones(()), ...)`. The row of docs/migrating.md takes those arrays as
    they are and caps the scale at 65504, where mpx clips it: the scale after every step and
    the skipped steps are mpx's (65504, 32752, 16376, ...)."""
    loss_scaling, min_loss_scaling, factor, period = mpx.FLOAT16_MAX, jnp.ones(()), 2, 2
    mapped = jls.DynamicLossScale(
        initial_loss_scale=loss_scaling,
        increment_period=period,
        multiplier=factor,
        min_loss_scale=min_loss_scaling,
        max_loss_scale=max(loss_scaling, 2.0**15),
    )
    assert mapped == jls.DynamicLossScale(65504.0, 2, 2.0, max_loss_scale=65504.0)
    ours = jls_run(optax.adam(0.1), mapped)
    scales = [65504.0, 65504.0, 32752.0, 32752.0, 16376.0, 16376.0, 32752.0, 32752.0]
    assert [scale for _, scale, _ in ours] == scales
    assert [skipped for *_, skipped in ours] == [False, False, True, False, True] + [False] * 3

    scaling = mpx.DynamicLossScaling(loss_scaling, min_loss_scaling, factor=factor, period=period)
    theirs = []
    for x in BATCHES:
        finite = mpx.all_finite(jax.grad(loss)(PARAMS, x))
        scaling = scaling.adjust(finite)
        theirs.append((float(scaling.loss_scaling), not bool(finite)))
    assert theirs == [(scale, skipped) for _, scale, skipped in ours]


def test_mpxs_scale_from_a_power_of_two_maps_to_one_capped_at_two_to_the_15():
    """From `loss_scaling=2.0**15` the row caps the scale at 2**15, so that it stays a power of
    two: mpx clips a grown 2**16 to 65504 instead."""
    loss_scaling = jnp.asarray(2.0**15)
    mapped = jls.DynamicLossScale(
        initial_loss_scale=loss_scaling,
        increment_period=2,
        min_loss_scale=jnp.ones(()),
        max_loss_scale=max(loss_scaling, 2.0**15),
    )
    ours = jls_run(optax.adam(0.1), mapped)
    assert [scale for _, scale, _ in ours] == [2.0**15] * 2 + [2.0**14] * 2 + [2.0**13] * 2 + [
        2.0**14
    ] * 2


def test_mpx_behaves_as_the_migration_page_says():
    """mpx 0.1.8, as docs/migrating.md describes it: `filter_value_and_grad` casts every argument
    to float16; for a float16 loss of 4 at a scale of 2**15 the loss value it returns is inf
    while its gradients are right and the step is not skipped; `force_full_precision` returns
    float16 by default; `cast_tree` leaves NumPy float64 arrays alone. The replacements: the
    loss's own value, gradients times the scale, float32 from `full_precision`, a cast."""
    seen = []

    def loss_fn(w, x):
        seen.append((w.dtype, x.dtype))
        return jnp.sum(w.astype(jnp.float16) * x.astype(jnp.float16))

    w, x = jnp.array([4.0, 8.0]), jnp.array([0.5, 0.25])  # loss 4, true gradients x
    scaling = mpx.DynamicLossScaling(jnp.float32(2.0**15), jnp.ones(()))
    value, scaling, grads_finite, grads = mpx.filter_value_and_grad(loss_fn, scaling)(w, x)
    assert seen.pop() == (jnp.float16, jnp.float16)
    assert bool(jnp.isinf(value))
    np.testing.assert_array_equal(grads, [0.5, 0.25])
    assert bool(grads_finite)
    assert float(scaling.loss_scaling) == 2.0**15

    opt_state = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(2.0**15)).init(w)
    value, grads = jls.value_and_grad(loss_fn, opt_state)(w, x)
    assert seen.pop() == (jnp.float32, jnp.float32)  # no cast: begin loss_fn with one
    assert (value.dtype, float(value)) == (jnp.float16, 4.0)
    np.testing.assert_array_equal(grads, [2.0**14, 2.0**13])

    half = jnp.ones(2, jnp.float16)
    assert mpx.force_full_precision(lambda a: a * 2)(half).dtype == jnp.float16
    assert jls.full_precision(lambda a: a * 2)(half).dtype == jnp.float32
    assert jls.full_precision(lambda a: a * 2, output_dtype=jnp.float16)(half).dtype == jnp.float16
    assert mpx.cast_tree(np.ones(2), jnp.float16).dtype == np.float64
    assert jls.cast_tree(np.ones(2), jnp.float16).dtype == np.float16


# --- flax's DynamicScale ----------------------------------------------------------------------


def flax_run(inner, dynamic_scale, batches=BATCHES, params=PARAMS, opt_state=None):
    """flax's ImageNet example's step: `dynamic_scale.value_and_grad`, then `jnp.where` on
    `is_fin` over the new and old params and optimizer state."""
    opt_state = inner.init(params) if opt_state is None else opt_state

    @jax.jit
    def train_step(params, opt_state, dynamic_scale, x):
        grad_fn = dynamic_scale.value_and_grad(lambda p: loss(p, x))
        dynamic_scale, is_fin, _, grads = grad_fn(params)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jax.tree.map, functools.partial(jnp.where, is_fin))
        return select(new_params, params), select(new_opt_state, opt_state), dynamic_scale, is_fin

    trace = []
    for x in batches:
        params, opt_state, dynamic_scale, is_fin = train_step(params, opt_state, dynamic_scale, x)
        trace.append((params, float(dynamic_scale.scale), not bool(is_fin)))
    return trace, (params, opt_state, dynamic_scale)


def flax_mapping(growth_interval, scale):
    """`DynamicScale(growth_interval=..., scale=...)` with its other defaults, as mapped."""
    return jls.DynamicLossScale(
        initial_loss_scale=scale,
        increment_period=growth_interval + 1,
        multiplier=2.0,
        backoff_factor=0.5,
        min_loss_scale=F32_TINY,
    )


@pytest.mark.parametrize("inner_name", INNERS)
def test_flax_dynamic_scale_step_and_its_replacement_scale_and_skip_step_for_step(inner_name):
    """growth_interval=1: flax grows on the 2nd consecutive finite step, as does
    `increment_period=growth_interval + 1`; NaN and inf batches skipped by both."""
    theirs, _ = flax_run(INNERS[inner_name](), DynamicScale(growth_interval=1, scale=2.0**15))
    ours = jls_run(INNERS[inner_name](), flax_mapping(1, 2.0**15))
    assert [scale for _, scale, _ in ours] == [
        2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15,
    ]  # fmt: skip
    assert_runs_agree(ours, theirs)


# --- Checkpoints of jmp and flax runs ---------------------------------------------------------


def resumed_from(opt_state, inner_state, loss_scale, good_steps):
    """The recipe of docs/migrating.md: a fresh `tx.init(params)` given the restored optimizer
    state, scale and count of consecutive finite steps."""
    return opt_state._replace(
        inner_state=inner_state,
        loss_scale_state=opt_state.loss_scale_state._replace(
            loss_scale=jnp.asarray(loss_scale, jnp.float32),
            good_steps=jnp.asarray(good_steps, jnp.int32),
        ),
    )


def continue_with_jls(tx, params, opt_state, batches):
    @jax.jit
    def train_step(params, opt_state, x):
        grads = jax.grad(lambda p: loss(p, x) * jls.get_loss_scale(opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    trace = []
    for x in batches:
        params, opt_state = train_step(params, opt_state, x)
        stats = jls.get_loss_scale_stats(opt_state)
        trace.append((params, float(stats.loss_scale), not bool(stats.last_step_applied)))
    return trace


def test_a_flax_checkpoint_with_dynamic_scale_resumes_inside_loss_scaled(tmp_path):
    """A flax run checkpointed by orbax mid-interval (its `dynamic_scale` holding a grown scale
    and 2 finite steps) continues under `loss_scaled` step for step as it would under flax."""
    inner = optax.sgd(0.1, momentum=0.9)
    first, rest = BATCHES[:4], (X_FINITE, X_INF, X_FINITE, X_FINITE, X_FINITE, X_FINITE)
    _, (params, opt_state, dynamic_scale) = flax_run(
        inner, DynamicScale(growth_interval=3, scale=2.0**10), first
    )
    assert (float(dynamic_scale.scale), int(dynamic_scale.fin_steps)) == (2.0**9, 1)
    checkpointer = ocp.StandardCheckpointer()
    saved = {"params": params, "opt_state": opt_state, "dynamic_scale": dynamic_scale}
    checkpointer.save(tmp_path / "flax", saved)
    checkpointer.wait_until_finished()

    theirs, _ = flax_run(inner, dynamic_scale, rest, params, opt_state)

    target = jax.eval_shape(lambda: saved)
    restored = checkpointer.restore(tmp_path / "flax", target)
    tx = jls.loss_scaled(inner, flax_mapping(3, 2.0**10))
    ds = restored["dynamic_scale"]
    resumed = resumed_from(
        tx.init(restored["params"]), restored["opt_state"], ds.scale, ds.fin_steps
    )
    ours = continue_with_jls(tx, restored["params"], resumed, rest)
    assert [scale for _, scale, _ in ours] == [2.0**9, 2.0**8, 2.0**8, 2.0**8, 2.0**8, 2.0**9]
    assert [skipped for *_, skipped in ours] == [False, True, False, False, False, False]
    assert_runs_agree(ours, theirs)


def test_a_jmp_checkpoint_of_scale_and_counter_resumes_inside_loss_scaled(tmp_path):
    """orbax cannot save a `jmp.DynamicLossScale` itself (its unflatten rejects the
    placeholders orbax maps over it), so a jmp run saves its `loss_scale` and `counter`
    arrays; restored into the state, the run continues step for step as jmp's would, its
    next growth on the step jmp's comes."""
    inner = optax.adam(0.1)
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**12), period=4, factor=2)
    with pytest.raises(AttributeError):
        ocp.StandardCheckpointer().save(tmp_path / "whole", {"loss_scale": loss_scale})

    _, (params, opt_state, loss_scale) = jmp_run(
        inner, loss_scale, True, (X_FINITE, X_INF, X_FINITE, X_FINITE)
    )
    assert (float(loss_scale.loss_scale), int(loss_scale.counter)) == (2.0**11, 2)
    saved = {
        "params": params,
        "opt_state": opt_state,
        "loss_scale": {"loss_scale": loss_scale.loss_scale, "counter": loss_scale.counter},
    }
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "jmp", saved)
    checkpointer.wait_until_finished()

    rest = (X_FINITE, X_FINITE, X_NAN, X_FINITE)
    theirs, _ = jmp_run(inner, loss_scale, True, rest, params, opt_state)

    restored = checkpointer.restore(tmp_path / "jmp", jax.eval_shape(lambda: saved))
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(2.0**12, increment_period=4, multiplier=2.0))
    arrays = restored["loss_scale"]
    resumed = resumed_from(
        tx.init(restored["params"]), restored["opt_state"], arrays["loss_scale"], arrays["counter"]
    )
    ours = continue_with_jls(tx, restored["params"], resumed, rest)
    assert [scale for _, scale, _ in ours] == [2.0**11, 2.0**12, 2.0**11, 2.0**11]
    assert_runs_agree(ours, theirs)
