"""XLA's program of the steps for an NVIDIA H100, compiled on this CPU (DESIGN 4.1).

`benchmarks/gpu_program.py` compiles against an H100's topology and counts the kernels of the
optimized program as the H100 ran them. These tests need the CUDA plugin, the gpu-compile
extra (`pip install -e ".[gpu-compile]"`, which CI installs); without it they are skipped, and
nothing else in the suite needs it. Sizes: the benchmark's 8M params in 64 leaves, since XLA
forms a step's kernels by size (at 16,384 entries a leaf it fuses the loss-scaled sgd step's
64 updates horizontally into 3 kernels, which at 125,000 it does not), and a GPT of one block.
"""

import functools
import pathlib

import jax
import pytest

pytest.importorskip("jax_plugins.xla_cuda13", reason="the gpu-compile extra is not installed")

from benchmarks import contenders, gpt, gpu_program, measure

LEAVES = 64
SIZE = 8_000_000
GRADIENT_BYTES = SIZE * 4
TINY_GPT = gpt.Size(layers=1, width=64, heads=1, seq=64, batch=2)


@functools.cache
def step_program(optimizer: str, contender: str, leaves: int = LEAVES) -> gpu_program.GpuProgram:
    params, grads = measure.params_and_grads(SIZE, leaves)
    make = {c.__name__: c for c in contenders.ALL}[contender]
    step = make(measure.OPTIMIZERS[optimizer]())
    state = jax.eval_shape(step.init, params)
    compiled = gpu_program.compile_for_h100(
        step.optimizer_step, params, state, grads, donate_argnums=(0, 1)
    )
    return gpu_program.gpu_program(compiled)


@functools.cache
def gpt_programs() -> dict[str, gpu_program.GpuProgram]:
    return gpu_program.gpt_steps(TINY_GPT, ("bare", "DynamicLossScale"))


@pytest.mark.parametrize(
    ("optimizer", "contender", "kernels"),
    [("adam", "bare", 66), ("sgd", "bare", 64), ("sgd", "jmp_select", 195)],
)
def test_kernels_are_counted_as_the_h100_ran_them(optimizer, contender, kernels):
    """The counts of DESIGN 4.1, which an H100 gave for these steps."""
    assert step_program(optimizer, contender).kernels == kernels


def test_a_conditional_counts_its_thunk_and_its_largest_branch():
    text = """HloModule m

%small (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %f = f32[] fusion(%p), kind=kLoop, calls=%x
}

%large (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %f = f32[] fusion(%p), kind=kLoop, calls=%x
  ROOT %g = f32[] custom-call(%f), custom_call_target="y"
}

ENTRY %main (a: pred[], b: f32[]) -> f32[] {
  %a = pred[] parameter(0)
  %b = f32[] parameter(1)
  %r = (f32[], pred[]) reduce(%b, %a, %b, %a), dimensions={}, to_apply=%z
  %c = f32[] copy(%b)
  ROOT %k = f32[] conditional(%a, %c, %c), true_computation=%small, false_computation=%large
}
"""
    computations = gpu_program._computations(text)
    entry = next(name for name in computations if name.startswith("ENTRY "))
    assert gpu_program._kernels(computations, entry) == 3  # the thunk, then a fusion and a call


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_loss_scaled_step_on_an_h100_has_no_conditional_nor_variadic_reduction(optimizer):
    program = step_program(optimizer, "jax_lossscale")
    assert program.conditionals == 0
    assert program.variadic_reductions == 0
    assert program.temp_bytes <= step_program(optimizer, "bare").temp_bytes + GRADIENT_BYTES


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("contender", ["bare", "jax_lossscale"])
def test_every_output_of_the_donated_step_is_written_over_its_argument(optimizer, contender):
    """No output is a fresh buffer: the new params and every state leaf, the statistics
    that no rule reads included, alias their donated arguments, so that XLA:GPU's command
    buffer finds the same addresses at every step and updates none of its kernels."""
    program = step_program(optimizer, contender)
    assert program.fresh_outputs == 0
    assert program.text.splitlines()[0].count("may-alias") >= LEAVES  # the params at least


# Reached: XLA merges kernels that share an operand larger than a scalar, and every leaf's
# check and update reads the two reciprocal factors of the scale as one pair: the 64 leaves'
# sums of squares in 8 kernels, their updates in 6 (adam) or 3 (sgd); and every computation
# of a scalar reads the vector that the step's scalars are stacked in
# (`_platforms.scalars_read_together`): one kernel writes it, two read it. adam 19, sgd 16
# (306 and 237 at d8baf18, 21 and 16 at 362f044; bare 66 and 64): pinned, so that nothing
# regresses.
REACHED = {"adam": 19, "sgd": 16}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_loss_scaled_step_on_an_h100_meets_design_4_1s_kernel_target(optimizer):
    """At most one kernel per gradient leaf and 4 more than the bare step, and no more than
    the program launches now."""
    kernels = step_program(optimizer, "jax_lossscale").kernels
    assert kernels <= step_program(optimizer, "bare").kernels + LEAVES + 4
    assert kernels <= REACHED[optimizer]


def test_one_leaf_of_8m_meets_the_kernel_target_under_adam_and_misses_it_by_one_under_sgd():
    """A step of one leaf launches the check's own kernels whatever the leaves: the factors'
    division, the two sums of squares, the scalars' vector and the two kernels that read it.
    adam's (bare 3) meets the target of bare + 1 + 4 with 7 (9 at 362f044, where adam's count
    and bias corrections took kernels of their own); sgd's (bare 1) takes 7, one above it."""
    adam = step_program("adam", "jax_lossscale", leaves=1).kernels
    assert adam == 7
    assert adam <= step_program("adam", "bare", leaves=1).kernels + 1 + 4
    sgd = step_program("sgd", "jax_lossscale", leaves=1).kernels
    assert sgd == 7
    assert sgd == step_program("sgd", "bare", leaves=1).kernels + 1 + 4 + 1


def test_the_gpt_step_on_an_h100_meets_design_4_1():
    """One kernel per gradient leaf and 4 more at most, no conditional and no variadic
    reduction, and at most one float32 gradient's bytes more temp memory than bare adamw."""
    programs = gpt_programs()
    bare, scaled = programs["bare"], programs["DynamicLossScale"]
    state = jax.eval_shape(lambda: gpt.train_state(TINY_GPT, 100, gpt.adamw())[1])
    parameters, leaves = gpt.parameter_count(state)
    assert leaves == 22
    assert scaled.kernels <= bare.kernels + leaves + 4
    assert scaled.conditionals == 0
    assert scaled.variadic_reductions == 0
    assert scaled.temp_bytes <= bare.temp_bytes + 4 * parameters


def test_the_vendored_target_config_is_the_shared_one():
    """benchmarks/h100_target_config.pbtxt is a copy of the shared one (../shared/gpu/), where
    the clone has it beside: the H100's device description, as XLA reads it."""
    vendored = gpu_program.TARGET_CONFIG.read_text()
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in vendored
    shared = pathlib.Path(__file__).parents[1].parent / "shared/gpu/h100_target_config.pbtxt"
    if shared.exists():
        assert shared.read_text() == vendored
