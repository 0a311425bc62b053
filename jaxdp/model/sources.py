"""Where each parameter of `DeepseekV3` comes from in a Hugging Face checkpoint, and how a box of it
(a slice per dimension, in our layout) is read: the name map, torch's [out, in] -> our [in, out]
transposes, gate/up stacking, per-expert tensors, and FP8 / NVFP4 handling.

A `Source` fills one parameter (or a group that is computed together: an FP8 weight and its scales, the
six NVFP4 arrays of a layer's experts). For a layer and the boxes of its parameters it returns arrays of
exactly those boxes, in the checkpoint's dtype (FP8 values stay FP8). Only the rows of each torch tensor
that a box needs are read. `check` validates the tensors' shapes before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

from jaxdp.config import ModelConfig
from jaxdp.model import fp8, indexer, modelopt
from jaxdp.model.checkpoint import Checkpoint, CheckpointError, Tiled, aligned_copy, assemble
from jaxdp.model.moe import NVFP4_PARAMS, nvfp4_expert_params

Box = tuple[slice, ...]
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


@dataclasses.dataclass
class Source:
    paths: tuple[str, ...]  # the state paths it fills (dotted, e.g. "moe_layers.attn.w_q_b_QHK")
    read: Callable[[Checkpoint, str, dict[str, Box]], dict[str, np.ndarray]]  # (ckpt, layer prefix, boxes)
    check: Callable[[Checkpoint, str], None]


def _flat(box: Box, dims: tuple[int, ...]) -> tuple[slice, Box]:
    """A box over factored dims (a, b, ..) -> the range of the flat torch dim that covers it, and the
    slices to apply after reshaping that range to (n, b, ..)."""
    inner = math.prod(dims[1:])
    head = box[0]
    rows = slice(head.start * inner, head.stop * inner)
    return rows, (slice(None), *box[1:])


def _torch_linear(ck: Checkpoint, name: str, in_dims, out_dims, box: Box, dense: bool,
                  block: int | None = None) -> np.ndarray:
    """torch[out, in] -> our [in.., out..] restricted to `box`. dense: dequantize FP8 / NVFP4 storage
    (FP8 in square blocks of `block`)."""
    n_in = len(in_dims)
    i_rng, i_post = _flat(box[:n_in], in_dims)
    o_rng, o_post = _flat(box[n_in:], out_dims)
    if dense and _quantized(ck, name):
        t = read_dense(ck, name, block, (o_rng, i_rng))
    else:
        t = ck.read(name, (o_rng, i_rng))
    n_o, n_i = box[n_in].stop - box[n_in].start, box[0].stop - box[0].start
    t = t.T.reshape(n_i, *in_dims[1:], n_o, *out_dims[1:])
    return t[(*i_post, *o_post)]  # a view: whoever places it copies it once, transposing as it goes


def _quantized(ck: Checkpoint, name: str) -> bool:
    base = name.removesuffix(".weight")
    return f"{base}.weight_scale_inv" in ck or f"{base}.weight_scale_2" in ck


def read_dense(ck: Checkpoint, name: str, block: int | None, box: tuple[slice, slice] | None = None) -> np.ndarray:
    """tensor[box] (torch's [out, in]; the whole tensor when None) of an FP8 or NVFP4 tensor as float32
    (for a parameter that is held dense; FP8 in square blocks of `block`, 128 when None). Only the box's
    values and the scales covering them are read and dequantized."""
    base = name.removesuffix(".weight")
    nvfp4 = f"{base}.weight_scale_2" in ck
    O, I = ck.shape(name)
    rows, cols = box or (slice(0, O), slice(0, I * 2 if nvfp4 else I))
    if nvfp4:  # two values a byte along `in`, one E4M3 scale per BLOCK_K of them: read whole groups
        g = modelopt.BLOCK_K
        lo, hi = cols.start // g * g, -(-cols.stop // g) * g
        w = modelopt.dequantize_weight(ck.read(name, (rows, slice(lo // 2, hi // 2))),
                                       ck.read(f"{base}.weight_scale", (rows, slice(lo // g, hi // g))),
                                       ck.read(f"{base}.weight_scale_2"))
        return w[:, cols.start - lo:cols.stop - lo]
    b = block or 128
    s = ck.read(f"{base}.weight_scale_inv", (slice(rows.start // b, -(-rows.stop // b)),
                                             slice(cols.start // b, -(-cols.stop // b))))
    s = np.repeat(np.repeat(s.astype(np.float32), b, axis=0), b, axis=1)
    r0, c0 = rows.start % b, cols.start % b
    w = ck.read(name, (rows, cols))
    w = (w.view(F8) if w.dtype == np.uint8 else w).astype(np.float32)
    return w * s[r0:r0 + w.shape[0], c0:c0 + w.shape[1]]


def _stacked(part: Callable[[int], dict[str, np.ndarray | Tiled]], over: slice, axis: int) -> dict[str, Tiled]:
    """{key: the parts for i in `over` stacked along `axis`}, as parts (never copied into one array here)."""
    got = [part(i) for i in range(over.start, over.stop)]
    return {k: Tiled.stack([g[k] for g in got], axis) for k in got[0]}


class Builder:
    """Makes the Source of each parameter for one model (config, FP8 block, quantization)."""

    def __init__(self, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], nvfp4_stored: bool,
                 input_scales: list):
        self.cfg, self.shapes = cfg, shapes  # shapes: per-layer (stack axis dropped)
        self.block = cfg.fp8_block[0] if cfg.fp8_block else None
        self.nvfp4_stored = nvfp4_stored  # NVFP4 experts as stored (ModelOpt), else quantized here if held so
        self.input_scales = input_scales  # ModelOpt input_scale values, appended per layer (logged)

    def _is_fp8(self, path: str) -> bool:
        return f"{path}{fp8.SCALE_SUFFIX}" in self.shapes

    # ---- the kinds of parameter ---------------------------------------------------------------
    def vector(self, path: str, fmt: str) -> Source:
        def read(ck, pre, boxes):
            return {path: ck.read(fmt.format(pre=pre), boxes[path])}

        return Source((path,), read, lambda ck, pre: ck.check_shape(fmt.format(pre=pre), self.shapes[path]))

    def linear(self, path: str, fmt: str, n_in: int) -> Source:
        """One torch Linear weight; `n_in` of our dims make up its input (the rest its output)."""
        shape = self.shapes[path]
        in_dims, out_dims = shape[:n_in], shape[n_in:]
        is_fp8 = self._is_fp8(path)

        def values(ck, name, box):
            if is_fp8:
                return self._fp8_linear(ck, name, in_dims, out_dims, box)
            return {"w": _torch_linear(ck, name, in_dims, out_dims, box, dense=True, block=self.block)}

        def read(ck, pre, boxes):
            got = values(ck, fmt.format(pre=pre), boxes[path])
            return self._named(path, got, boxes)

        def check(ck, pre):
            self._check_linear(ck, fmt.format(pre=pre), in_dims, out_dims, is_fp8)

        return Source(self._paths(path), read, check)

    def gate_up(self, path: str, experts: bool) -> Source:
        """[(E,) D, 2, F]: gate (0) and up (1) stacked; per expert when `experts`."""
        shape = self.shapes[path]
        D, F = shape[-3], shape[-1]
        is_fp8 = self._is_fp8(path)

        def one(ck, name, box):
            if is_fp8:
                return self._fp8_linear(ck, name, (D,), (F,), box)
            return {"w": _torch_linear(ck, name, (D,), (F,), box, dense=True, block=self.block)}

        def layer(ck, pre, box):  # box over [D, 2, F]
            names = ("gate", "up")
            return _stacked(lambda j: one(ck, f"{pre}.{names[j]}_proj.weight", (box[0], box[2])), box[1], 1)

        return self._maybe_experts(path, experts, layer, lambda ck, pre: [
            self._check_linear(ck, f"{pre}.{p}_proj.weight", (D,), (F,), is_fp8) for p in ("gate", "up")])

    def down(self, path: str, experts: bool) -> Source:
        shape = self.shapes[path]
        F, D = shape[-2], shape[-1]
        is_fp8 = self._is_fp8(path)

        def layer(ck, pre, box):
            name = f"{pre}.down_proj.weight"
            if is_fp8:
                return self._fp8_linear(ck, name, (F,), (D,), box)
            return {"w": _torch_linear(ck, name, (F,), (D,), box, dense=True, block=self.block)}

        return self._maybe_experts(path, experts, layer, lambda ck, pre: self._check_linear(
            ck, f"{pre}.down_proj.weight", (F,), (D,), is_fp8))

    def _maybe_experts(self, path, experts: bool, layer, check_one) -> Source:
        mlp = {"ffn.w_gate_up_D2F": "mlp", "ffn.w_down_FD": "mlp", "ffn.shared.w_gate_up_D2F": "mlp.shared_experts",
               "ffn.shared.w_down_FD": "mlp.shared_experts"}
        sub = path.split(".", 1)[1]
        if not experts:
            def read(ck, pre, boxes):
                return self._named(path, layer(ck, f"{pre}.{mlp[sub]}", boxes[path]), boxes)

            return Source(self._paths(path), read, lambda ck, pre: check_one(ck, f"{pre}.{mlp[sub]}"))

        def read_experts(ck, pre, boxes):
            box = boxes[path]
            if f"{pre}.mlp.experts.gate_up_proj" in ck:  # transformers' fused in-memory layout (dense)
                w = self._fused(ck, pre, path, box)
                if not self._is_fp8(path):
                    return {path: w}
                blocks = fp8.scale_blocks(path.rsplit(".", 1)[-1], self.shapes[path], self.block)
                values, scale = fp8.quantize(w, blocks)
                return self._named(path, {"w": values, "s": scale}, boxes)
            return self._named(path, _stacked(lambda e: layer(ck, f"{pre}.mlp.experts.{e}", box[1:]), box[0], 0),
                               boxes)

        def check(ck, pre):
            if f"{pre}.mlp.experts.gate_up_proj" in ck:
                return
            for e in range(self.cfg.n_routed_experts):
                check_one(ck, f"{pre}.mlp.experts.{e}")

        return Source(self._paths(path), read_experts, check)

    def _fused(self, ck, pre, path, box) -> np.ndarray:
        I = self.cfg.moe_intermediate_size
        if path.endswith("w_gate_up_ED2I"):
            gu = ck.read(f"{pre}.mlp.experts.gate_up_proj", (box[0],))  # [E, 2I, D]
            out = np.stack([gu[:, :I].transpose(0, 2, 1), gu[:, I:].transpose(0, 2, 1)], axis=2)
        else:
            out = ck.read(f"{pre}.mlp.experts.down_proj", (box[0],)).transpose(0, 2, 1)  # [E, D, I] -> [E, I, D]
        return aligned_copy(out[(slice(None), *box[1:])])

    def nvfp4_experts(self, stack: str) -> Source:
        """The six NVFP4 arrays of a layer's routed experts: read whole (one layer) and sliced; quantized
        here from the dense experts when the checkpoint has them dense."""
        paths = tuple(f"{stack}.ffn.{k}" for k in NVFP4_PARAMS)
        E, D, I = self.cfg.n_routed_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        gu_path, dn_path = f"{stack}.ffn.w_gate_up_ED2I", f"{stack}.ffn.w_down_EID"
        dense = Builder(self.cfg, {**self.shapes, gu_path: (E, D, 2, I), dn_path: (E, I, D)}, False, [])
        gu_src, dn_src = dense.gate_up(gu_path, True), dense.down(dn_path, True)

        def read(ck, pre, boxes):
            if self.nvfp4_stored:
                q, scales = modelopt.read_nvfp4_experts(ck.read, ck.__contains__, pre, self.cfg)
                self.input_scales.append(scales)
            else:
                gu = assemble(gu_src.read(ck, pre, {gu_path: full_box((E, D, 2, I))})[gu_path])
                dn = assemble(dn_src.read(ck, pre, {dn_path: full_box((E, I, D))})[dn_path])
                q = nvfp4_expert_params(gu.astype(np.float32), dn.astype(np.float32))
            return {p: aligned_copy(np.asarray(q[k])[boxes[p]]) for p, k in zip(paths, NVFP4_PARAMS, strict=True)}

        if self.nvfp4_stored:
            return Source(paths, read, lambda ck, pre: None)
        return Source(paths, read, lambda ck, pre: (gu_src.check(ck, pre), dn_src.check(ck, pre)))

    def indexer(self, stack: str) -> list[Source]:
        """The DSA indexer's weights of a layer (small, whole on every device): read whole, in our layout;
        a "shared" layer has none and gets zeros (never read: it reuses the previous full layer's selection)."""
        return [self._indexer_one(f"{stack}.attn.indexer.{name}", hf, how)
                for name, (hf, how) in indexer.HF_NAMES.items() if f"{stack}.attn.indexer.{name}" in self.shapes]

    def _indexer_one(self, path: str, hf: str, how: str | None) -> Source:
        shape = self.shapes[path]

        def full(pre: str) -> bool:  # an MTP layer (past the model's layers) always runs its own indexer
            layer = int(pre.rsplit(".", 1)[1])
            return layer >= self.cfg.num_layers or self.cfg.indexer_full[layer]

        def read(ck, pre, boxes):
            if not full(pre):
                return {path: np.zeros(tuple(s.stop - s.start for s in boxes[path]), np.float32)}
            name = f"{pre}.self_attn.indexer.{hf}"
            w = read_dense(ck, name, self.block) if _quantized(ck, name) else ck.read(name)
            return {path: aligned_copy(indexer.hf_layout(w, how, shape)[boxes[path]])}

        def check(ck, pre):
            if full(pre):
                ck.check_shape(f"{pre}.self_attn.indexer.{hf}", indexer.hf_shape(how, shape))

        return Source((path,), read, check)

    # ---- FP8 ------------------------------------------------------------------------------------
    def _fp8_linear(self, ck, name, in_dims, out_dims, box) -> dict[str, np.ndarray]:
        """{"w": e4m3 values of the box, "s": their scales}: as stored, or quantized here from a dense weight."""
        b = self.block
        blocks = fp8.group_blocks(in_dims, b) + fp8.group_blocks(out_dims, b)
        sbox = tuple(slice(s.start // k, -(-s.stop // k)) for s, k in zip(box, blocks, strict=True))
        if ck.dtype(name) != F8:
            w = _torch_linear(ck, name, in_dims, out_dims, box, dense=True, block=self.block).astype(np.float32)
            values, scale = fp8.quantize(w, tuple(blocks))
            return {"w": aligned_copy(values), "s": aligned_copy(scale)}
        values = _torch_linear(ck, name, in_dims, out_dims, box, dense=False)
        s = ck.read(name.removesuffix(".weight") + ".weight_scale_inv")
        return {"w": values, "s": fp8.scale_from_torch(s, in_dims, out_dims, b)[sbox]}  # a view, as the values

    def _check_linear(self, ck, name, in_dims, out_dims, is_fp8: bool) -> None:
        O, I = math.prod(out_dims), math.prod(in_dims)
        nvfp4 = name.removesuffix(".weight") + ".weight_scale_2" in ck
        ck.check_shape(name, (O, I // 2) if nvfp4 else (O, I))  # NVFP4: two values a byte
        scale = name.removesuffix(".weight") + ".weight_scale_inv"
        if ck.dtype(name) == F8:
            if scale not in ck:
                raise CheckpointError(f"tensor {name!r} in {ck.where(name)} is float8 but {scale!r} is missing")
            b = self.block or 128
            want = (-(-O // b), -(-I // b))
            if ck.shape(scale) != want:
                raise CheckpointError(
                    f"scale tensor {scale!r} in {ck.where(scale)} has shape {list(ck.shape(scale))}, but a weight "
                    f"of shape {[O, I]} in the {b}x{b} blocks that config.json declares (weight_block_size) needs "
                    f"{list(want)}; the checkpoint and its config disagree")
            if not is_fp8 and self.block is None:
                raise CheckpointError(f"tensor {name!r} in {ck.where(name)} is block-FP8 but config.json declares "
                                      "no quantization_config with quant_method 'fp8'")

    def _paths(self, path: str) -> tuple[str, ...]:
        return (path, path + fp8.SCALE_SUFFIX) if self._is_fp8(path) else (path,)

    def _named(self, path: str, got: dict[str, np.ndarray], boxes: dict[str, Box]) -> dict[str, np.ndarray]:
        out = {path: got["w"]}
        if "s" in got:
            scale_path = path + fp8.SCALE_SUFFIX
            out[scale_path] = got["s"]
            if out[scale_path].shape != tuple(s.stop - s.start for s in boxes[scale_path]):
                raise CheckpointError(f"{path}: FP8 blocks of {self.block} do not line up with how this layout "
                                      "splits the weight; choose a layout whose slices are whole blocks")
        return out


def sources(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], *, nvfp4_stored: bool,
            input_scales: list) -> tuple[list[Source], dict[str, list[Source]]]:
    """(the sources of the parameters outside the stacks, {stack: the sources of one of its layers})."""
    b = Builder(cfg, shapes, nvfp4_stored, input_scales)
    top = [Source(("embed_VD",), lambda ck, pre, boxes: {"embed_VD": ck.read("model.embed_tokens.weight",
                                                                            boxes["embed_VD"])},
                  lambda ck, pre: ck.check_shape("model.embed_tokens.weight", shapes["embed_VD"])),
           b.vector("final_norm", "model.norm.weight")]
    if "lm_head_DV" in shapes:
        top.append(b.linear("lm_head_DV", "lm_head.weight", 1))
    return top, _stack_sources(b, shapes)


def mtp_sources(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], prefix: str, *, nvfp4_stored: bool,
                input_scales: list) -> tuple[list[Source], dict[str, list[Source]]]:
    """`sources` of an MTP layer (`jaxdp.model.mtp.MTPLayer`) stored under `prefix` (model.layers.{L}): its
    own norms and eh_proj (dense; dequantized if stored quantized), and its decoder layer read as a stack of
    one, exactly as the main model's layers are."""
    b = Builder(cfg, shapes, nvfp4_stored, input_scales)
    top = [b.vector("enorm", f"{prefix}.enorm.weight"), b.vector("hnorm", f"{prefix}.hnorm.weight"),
           b.linear("w_eh_XD", f"{prefix}.eh_proj.weight", 1),
           b.vector("shared_head_norm", f"{prefix}.shared_head.norm.weight")]
    return top, _stack_sources(b, shapes)


def _stack_sources(b: Builder, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Source]]:
    stacks: dict[str, list[Source]] = {}
    for stack in ("dense_layers", "moe_layers"):
        if f"{stack}.attn_norm" not in shapes:
            continue
        a = f"{stack}.attn."
        srcs = [b.vector(f"{stack}.attn_norm", "{pre}.input_layernorm.weight"),
                b.vector(f"{stack}.ffn_norm", "{pre}.post_attention_layernorm.weight"),
                b.vector(a + "kv_a_norm", "{pre}.self_attn.kv_a_layernorm.weight"),
                b.linear(a + "w_kv_a_DK", "{pre}.self_attn.kv_a_proj_with_mqa.weight", 1),
                b.linear(a + "w_kv_b_LHX", "{pre}.self_attn.kv_b_proj.weight", 1),
                b.linear(a + "w_o_HVD", "{pre}.self_attn.o_proj.weight", 2)]
        if a + "w_q_a_DQ" in shapes:
            srcs += [b.linear(a + "w_q_a_DQ", "{pre}.self_attn.q_a_proj.weight", 1),
                     b.vector(a + "q_a_norm", "{pre}.self_attn.q_a_layernorm.weight"),
                     b.linear(a + "w_q_b_QHK", "{pre}.self_attn.q_b_proj.weight", 1)]
        else:
            srcs.append(b.linear(a + "w_q_DHK", "{pre}.self_attn.q_proj.weight", 1))
        srcs += b.indexer(stack)
        f = f"{stack}.ffn."
        if stack == "dense_layers":
            srcs += [b.gate_up(f + "w_gate_up_D2F", False), b.down(f + "w_down_FD", False)]
        else:
            srcs += [b.linear(f + "router_DE", "{pre}.mlp.gate.weight", 1),
                     b.vector(f + "router_bias_E", "{pre}.mlp.gate.e_score_correction_bias")]
            if f + "w_gate_up_packed" in shapes:
                srcs.append(b.nvfp4_experts(stack))
            else:
                srcs += [b.gate_up(f + "w_gate_up_ED2I", True), b.down(f + "w_down_EID", True)]
            if f + "shared.w_gate_up_D2F" in shapes:
                srcs += [b.gate_up(f + "shared.w_gate_up_D2F", False), b.down(f + "shared.w_down_FD", False)]
        stacks[stack] = srcs
    return stacks


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple(slice(0, d) for d in shape)

