"""How the model declares a weight: with its logical axes, one name per dimension (`param`), which
`jaxdp.parallel.sharding` maps to the mesh under a layout; and its random initialisation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

AXES = "axes"  # the nnx.Param metadata field that holds a weight's logical axes


def param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """A weight with its logical axes, one name per dimension of one layer's weight (a stack's layer axis is
    added where the stack is made, `jaxdp.model.decoder._layer_stack`); the names are those the rules of
    `jaxdp.parallel.sharding` know."""
    if len(axes) != len(value.shape):
        raise ValueError(f"{len(axes)} logical axes {axes} for a weight of shape {value.shape}")
    return nnx.Param(value, **{AXES: tuple(axes)})


def axes_of(variable: nnx.Variable) -> tuple[str, ...] | None:
    """The logical axes a weight declared (`param`), None when it declared none."""
    return variable.get_metadata().get(AXES)


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, fan_in: int) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
