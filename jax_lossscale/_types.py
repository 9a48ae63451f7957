"""Type aliases shared by the modules."""

from typing import Any

PyTree = Any
AxisName = Any  # a named axis of pmap / shard_map, or a tuple of them
