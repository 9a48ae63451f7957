"""Host and device time a step, read from a `jax.profiler` trace (the GPU case set's).

A step on a GPU is often bound by the host: XLA:GPU's work for one execution of a program is
the host event `GpuExecutable::ExecuteThunks`, within which it updates and launches its
command buffers (events `command_buffer...`); the device's is the kernels and copies on the
GPU's streams (the lines `Stream ...` of each `/device:GPU:` plane). On another platform the
host time is that of PjRt's execution (`...ExecuteHelper...`) and there is no device time.

Under the profiler XLA:GPU runs a command buffer's kernels one by one, unless XLA is told
otherwise: run the case set with
`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true` to profile the program as it
runs unprofiled.
"""

import glob
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax
from jax.profiler import ProfileData

HOST_EVENTS = ("GpuExecutable::ExecuteThunks", "ExecuteHelper")  # the first found is reported


def per_step(run: Callable[[int], Any], steps: int) -> dict[str, Any]:
    """`run(steps)` under the profiler: microseconds a step on the host and on the device."""
    directory = tempfile.mkdtemp(prefix="jax_lossscale-profile-")
    try:
        with jax.profiler.trace(directory):
            run(steps)
        [path] = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        return times_per_step(ProfileData.from_file(path), steps)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def times_per_step(data: Any, steps: int) -> dict[str, Any]:
    """The summed durations (us) a step of the host's execution events, of the command
    buffers' within them, and of the device's stream events, from a `ProfileData`; None for
    what the trace does not have."""
    host: dict[str, int] = {}
    command_buffers = device = 0
    gpu = False
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            gpu = True
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    device += sum(event.duration_ns for event in line.events)
        elif plane.name.startswith("/host:"):
            for line in plane.lines:
                for event in line.events:
                    for name in HOST_EVENTS:
                        if name in event.name:
                            host[name] = host.get(name, 0) + event.duration_ns
                    if event.name.startswith("command_buffer"):
                        command_buffers += event.duration_ns
    event = next((name for name in HOST_EVENTS if name in host), None)
    microseconds = 1e3 * steps
    return {
        "host_event": event,
        "host_us": host[event] / microseconds if event else None,
        "command_buffer_us": command_buffers / microseconds if gpu else None,
        "device_us": device / microseconds if gpu else None,
    }
