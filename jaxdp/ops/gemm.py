"""The projection GEMM (a Linear weight of the layers, bf16 / float32 or block-FP8, times its input) and the LM
head's product, each with its backends (`jaxdp.ops.registry`: `projection_gemm`, `lm_head`).

`projection(eq, x, w, dense_dot)` multiplies a weight the layer scan handed whole (`StackedWeight`) by x, the
einsum `eq` (x first), with the weight's backend (`--fp8-gemm-backend`, carried by the weight):

- xla: the layer sliced out of the stack, dequantized, then `dense_dot` (the model's product);
- pallas: `kernels_pallas.fp8_gemm`: `fp8_matmul` where eq contracts x's trailing dims with the weight's leading
  ones, `fp8_head_matmul` for a product per head with a weight [A, H, B] (or a view of columns of B) contracting A
  ("...ha,ahb->...hb") or B ("...hb,ahb->...ha"); the FP8 tiles dequantized in registers, the layer read where it
  lies (XLA:GPU neither fuses a multiply by the block scales into its GEMMs nor reads a layer of a stack in place,
  docs/gpu-on-paper.md). Compiled on a GPU, interpreted on a CPU;
- native (a CPU's): `jaxdp.native`'s grouped and per-head products reading a plain float32 / bf16 layer in place;
- None (no flag): the platform's default, picked where the step is lowered (`lax.platform_dependent`): native on
  a CPU, pallas elsewhere.
Each falls back to xla for what it does not take (a shape its kernel does not tile, a block-FP8 weight for native,
a view of columns for `fp8_matmul`). The kernels have no derivative: training differentiates the xla form.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxdp import native
from jaxdp.ops.stacked import InStack, StackedWeight
from kernels_pallas.fp8_gemm import fp8_head_matmul, fp8_matmul, tiles


def _split(eq: str) -> tuple[str, str, str, int]:
    lhs, out = eq.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
    return xs, ws, out, (len(xs) + len(ws) - len(out)) // 2


def _trailing(xs: str, ws: str, out: str, n_in: int) -> bool:
    """eq contracts x's trailing n_in dims with the weight's leading ones, in order ("td,dq->tq")."""
    return bool(n_in) and xs[len(xs) - n_in:] == ws[:n_in] and out == xs[:len(xs) - n_in] + ws[n_in:]


def _per_head(xs: str, ws: str, out: str) -> str | None:
    """"A" or "B" when eq is a product per head with a weight [A, H, B] contracting A or B; else None."""
    if len(ws) == 3 and len(xs) >= 2 and xs[-2] == ws[1] and xs[-1] in (ws[0], ws[2]) and (
            out == xs[:-1] + ws[2 if xs[-1] == ws[0] else 0]):
        return "A" if xs[-1] == ws[0] else "B"
    return None


def pallas_form(eq: str, x, w: StackedWeight, out_dtype):
    """The Pallas GEMM of `x` by `w` for eq, as a function (x, interpret) -> y, or None where no kernel tiles it."""
    xs, ws, out, n_in = _split(eq)
    if _trailing(xs, ws, out, n_in):
        operands = w.gemm_operands(n_in)
        if operands is None:
            return None

        def gemm(x, interpret):
            v, s, cols = operands
            y = fp8_matmul(x.reshape(-1, v.shape[1]), v, s, cols, w.layer, interpret=interpret, out_dtype=out_dtype)
            return y.reshape(*x.shape[:x.ndim - n_in], *w.shape[n_in:])
        return gemm
    contract = _per_head(xs, ws, out)
    operands = None if contract is None else w.head_operands(contract)
    if operands is None:
        return None

    def head_gemm(x, interpret):
        v, s, cols = operands
        offset = 0 if w.cols is None else w.cols[0]
        y = fp8_head_matmul(x.reshape(-1, *x.shape[-2:]), v, s, cols, w.layer, offset=offset, width=w.shape[2],
                            contract=contract, interpret=interpret, out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return head_gemm


def native_form(eq: str, x, w: StackedWeight, out_dtype):
    """`jaxdp.native`'s product of x by w for eq, as a function (x, values, layer) -> y, or None where it does not
    apply: a block-FP8 weight, another form, per-head widths not multiples of 16, no kernels built on this machine.
    Forms: x's trailing dims by the weight's leading ones ("td,dq->tq", all its columns), or a product per head with a
    weight [A, H, X] or a view of some columns of X contracting A ("bhl,lhv->bhv") or the columns
    ("bhn,lhn->bhl")."""
    if w.scales is not None:
        return None
    xs, ws, out, n_in = _split(eq)
    if w.cols is None and _trailing(xs, ws, out, n_in):
        if not native.takes(x, w.values):
            return None
        k = math.prod(w.shape[:n_in])

        def gemm(x, values, layer):  # the layer read in place
            y = native.matmul(x.reshape(-1, k), values.reshape(values.shape[0], k, -1), layer)
            return y.reshape(*x.shape[:x.ndim - n_in], *w.shape[n_in:]).astype(out_dtype)
        return gemm
    contract = _per_head(xs, ws, out) if len(xs) == 3 else None
    if contract is None or w.shape[0] % 16 or w.shape[2] % 16 or not native.takes(x, w.values):
        return None

    def head_gemm(x, values, layer):  # per head, the columns read in place
        offset = 0 if w.cols is None else w.cols[0]
        return native.head_matmul(x, values, layer, offset, w.shape[2], contract).astype(out_dtype)
    return head_gemm


def projection(eq: str, x, w: StackedWeight, dense_dot, out_dtype=None, backend: str | None = None):
    """einsum(eq, x, w) as `dense_dot(eq, x, layer)` computes it (x's dtype out, or `out_dtype`; float32
    accumulation) by `backend` (None: the weight's, `w.backend`; see the module's docstring)."""
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    backend = w.backend if backend is None else backend

    def dense(x, values, scales, layer):
        return dense_dot(eq, x, w.like(values, scales, layer).dense()).astype(out_dtype)

    if backend == "xla":
        return dense(x, w.values, w.scales, w.layer)
    gemm = pallas_form(eq, x, w, out_dtype) if backend in (None, "pallas") else None
    if backend == "pallas":
        return dense(x, w.values, w.scales, w.layer) if gemm is None else gemm(x, None)
    cpu_form = native_form(eq, x, w, out_dtype)
    if gemm is None and cpu_form is None:
        return dense(x, w.values, w.scales, w.layer)

    def cpu(x, values, scales, layer):
        return dense(x, values, scales, layer) if cpu_form is None else cpu_form(x, values, layer)

    def elsewhere(x, values, scales, layer):  # under "native", a GPU's lowering takes the xla form
        return dense(x, values, scales, layer) if gemm is None else gemm(x, False)

    @jax.custom_jvp
    def product(x, values, scales, layer):
        return jax.lax.platform_dependent(x, cpu=lambda x: cpu(x, values, scales, layer),
                                          default=lambda x: elsewhere(x, values, scales, layer))

    product.defjvp(lambda primals, tangents: jax.jvp(dense, primals, tangents))
    return product(x, w.values, w.scales, w.layer)


def einsum(eq: str, x, w, preferred_element_type=None):
    """jnp.einsum(eq, x, w, preferred_element_type=...) for a weight that may be a `StackedWeight` (then the
    projection GEMM by its backend, this very einsum of the dequantized layer as its xla form)."""
    if not isinstance(w, StackedWeight):
        return jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type)
    out = preferred_element_type or jnp.result_type(x.dtype, w.dtype)
    return projection(eq, x, w, lambda eq, x, w: jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type),
                      out_dtype=out)


def router_logits(x_TD, router_DE) -> jax.Array:
    """x @ router in float32. A router handed whole (`InStack`, under the pallas MoE runner) is multiplied where
    the step is lowered for a GPU by the Pallas GEMM reading its layer in place (XLA:GPU would copy the layer out
    of the stack for its GEMM). On a CPU, jaxdp's native product where it is built (`native.dense_matmul`, the
    router's columns): XLA:CPU's dot of [T, D] by [D, E] blocks its sums by T, so a
    row's logits, and with them its experts' weights, depended on the rows beside it (docs/determinism.md)."""
    x32 = x_TD.astype(jnp.float32)

    def cpu(x32):
        return native.dense_matmul(x32, router_DE[...].astype(jnp.float32))

    if not isinstance(router_DE, InStack) or not tiles(*router_DE.shape):
        return jax.lax.platform_dependent(x32, cpu=cpu, default=lambda x32: x32 @ router_DE[...].astype(jnp.float32))

    def gemm(x32):
        return fp8_matmul(x32, router_DE.stack, None, None, router_DE.layer, interpret=False)

    return jax.lax.platform_dependent(x32, cpu=cpu, default=gemm)


def lm_head_product(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """The LM head: x @ w accumulated and returned in float32 (a weight held whole): native on a CPU where the
    kernels are built (`jaxdp.native.dense_matmul`: XLA:CPU's one-row products read at half the machine's
    bandwidth), xla elsewhere; differentiable (the derivative is XLA's product's)."""
    return native.dense_matmul(x_MK, w_KN)
