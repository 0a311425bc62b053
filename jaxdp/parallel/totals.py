"""Totals every process can read: an array split over the devices, summed over its device axis into one array whole
on every device (an all-reduce that XLA lays out over the mesh, across processes when the mesh spans several nodes).

Online EPLB (`jaxdp.eplb.online`) needs the sum: each device counts the tokens its own rows routed ([devices, layers,
experts], one row a device), and every node must place the experts from the same sum, so that every node decides the
same placement and then runs the same compiled move. A process reads only its own devices' pieces of a split array;
the summed array is whole on each of them, so each process reads the whole total from its first device. The
expert-distribution recorder's dump (`jaxdp.eplb.recorder`) needs every device's own row of counts: the gather.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["compiled_device_sum", "compiled_gather", "read_whole"]


def compiled_device_sum(split: jax.ShapeDtypeStruct):
    """The sum over axis 0 of arrays like `split` ([devices, ...] split over the mesh), whole on every device of the
    mesh: compiled now (before serving), so a sum taken while serving compiles nothing."""
    whole = NamedSharding(split.sharding.mesh, P())
    return jax.jit(lambda x: x.sum(0, dtype=x.dtype), out_shardings=whole).lower(split).compile()


def compiled_gather(split: jax.ShapeDtypeStruct):
    """Arrays like `split` (split over the mesh) gathered whole onto every device of the mesh, values unchanged (an
    all-gather, across processes when the mesh spans several nodes): compiled now, before serving. The
    expert-distribution recorder's dump reads every device's counts this way on a model spanning several nodes."""
    whole = NamedSharding(split.sharding.mesh, P())
    return jax.jit(lambda x: x, out_shardings=whole).lower(split).compile()


def read_whole(x: jax.Array) -> np.ndarray:
    """An array whole on every device (as `compiled_device_sum` returns it) on the host, from this process's first
    device: every process reads the same values."""
    if not x.is_fully_replicated:
        raise ValueError("read_whole reads arrays held whole on every device; sum or gather it first")
    return np.asarray(x.addressable_data(0))
