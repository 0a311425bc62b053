"""Where each weight lives: every parameter's PartitionSpec under every layout, for the tiny, DSA and MTP
models, dense, block-FP8 and NVFP4, is the one the rules by parameter name gave before the weights declared
their logical axes (`jaxdp.parallel.sharding`).

`name_rule_spec` is that earlier rule, frozen here as it stood (jaxdp/parallel/sharding.py `param_spec` at
d8ff1fb, which parsed the parameter's path): the expected table, computed. Specs are compared as shardings
(trailing unsplit axes dropped: P(None, None) and P() place an array alike).
"""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxdp.config import PRESETS
from jaxdp.layout import available_presets, parse_mesh_spec
from jaxdp.model.sharded import abstract_model, abstract_mtp

ALL = ("dp", "tp")
_EXPERT_I_AXIS = {
    "w_gate_up_ED2I": 4, "w_down_EID": 2,
    "w_gate_up_packed": 3, "w_gate_up_scale": 3, "w_gate_up_gscale": None,
    "w_down_packed": 3, "w_down_scale": 3, "w_down_gscale": None,
}
_REPLICATED = frozenset({
    "embed_VD", "attn_norm", "ffn_norm", "final_norm", "weight", "q_a_norm", "kv_a_norm", "k_norm", "k_norm_bias",
    "router_DE", "router_bias_E", "w_q_a_DQ", "w_kv_a_DK", "w_q_QIE", "w_k_DE", "w_weights_DI",
    "enorm", "hnorm", "w_eh_XD", "shared_head_norm",
})


def name_rule_spec(path: str, ndim: int, layout) -> P:
    """The PartitionSpec the rule by name gave (frozen copy, see the module docstring)."""
    name = path.split("['")[-1].split("']")[0].removesuffix("_bscale")
    in_dense = "dense_layers" in path
    in_shared = "['shared']" in path
    heads_on_tp = {
        "w_q_b_QHK": P(None, None, "tp", None),
        "w_q_DHK": P(None, None, "tp", None),
        "w_kv_b_LHX": P(None, None, "tp", None),
        "w_o_HVD": P(None, "tp", None, None),
    }
    if name in heads_on_tp:
        return heads_on_tp[name]
    if name in _EXPERT_I_AXIS:
        split = 1 if layout.moe == "ep" else _EXPERT_I_AXIS[name]
        return P(*(ALL if axis == split else None for axis in range(ndim)))
    if name in ("w_gate_up_D2F", "w_down_FD"):
        replicated = (in_dense and layout.dense_replicated) or (in_shared and layout.moe == "ep")
        if replicated:
            return P()
        return P(None, None, None, ALL) if name == "w_gate_up_D2F" else P(None, ALL, None)
    if name == "lm_head_DV":
        replicated = layout.dp_lm_head or layout.world == 1
        return P() if replicated else P(None, ALL)
    if name in _REPLICATED:
        return P()
    raise AssertionError(f"the frozen rule does not know {path}")


# every preset in jaxdp/meshes/ (at 8 devices), the layouts tests/test_layouts.py runs, and one device
LAYOUTS = sorted({*available_presets(), "dp=1", "tp=8", "dp=8", "dp=2,tp=4", "dp=4,tp=2", "dp=8,moe=ep",
                  "dp=8,lm_head=dp", "dp=8,dense=replicated", "dp=8,lm_head=a2a", "dp=4,tp=2,moe=ep"})
MODELS = {  # name -> (config, whether the model or its MTP layer)
    "tiny": (PRESETS["tiny"], False),
    "tiny-no-q-lora": (PRESETS["tiny"].with_(q_lora_rank=None), False),
    "tiny-tied": (PRESETS["tiny"].with_(tie_word_embeddings=True), False),
    "glm-5-tiny": (PRESETS["glm-5-tiny"], False),
    "tiny-mtp": (PRESETS["tiny"].with_(num_nextn_predict_layers=1), True),
    "glm-5-tiny-mtp": (PRESETS["glm-5-tiny"].with_(num_nextn_predict_layers=1), True),
    "tiny-dense-mtp": (PRESETS["tiny"].with_(num_nextn_predict_layers=1, num_layers=1, first_k_dense_replace=2),
                       True),
}


def _canonical(spec: P) -> tuple:
    t = tuple(spec)
    while t and t[-1] is None:
        t = t[:-1]
    return t


@pytest.mark.parametrize("quantization", [None, "fp8", "nvfp4"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_parameter_sits_where_the_rules_by_name_put_it(model, quantization):
    import jax
    from flax import nnx

    from jaxdp.parallel.sharding import state_specs

    cfg, mtp = MODELS[model]
    abstract = (abstract_mtp if mtp else abstract_model)(cfg, jnp.bfloat16, quantization)
    _, state = nnx.split(abstract)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    names = {jax.tree_util.keystr(p).split("['")[-1].split("']")[0] for p, _ in leaves}
    if quantization == "fp8":
        assert any(n.endswith("_bscale") for n in names)
    if quantization == "nvfp4" and not model.startswith("tiny-dense"):
        assert "w_gate_up_packed" in names
    assert len(leaves) >= 10
    for spec in LAYOUTS:
        layout = parse_mesh_spec(spec, 8)
        got = jax.tree.leaves(state_specs(state, layout), is_leaf=lambda x: isinstance(x, P))
        assert len(got) == len(leaves)
        for (path, x), s in zip(leaves, got, strict=True):
            where = jax.tree_util.keystr(path)
            assert _canonical(s) == _canonical(name_rule_spec(where, x.ndim, layout)), (spec, where, s)


def _tiny_abstract():
    from flax import nnx

    from jaxdp.model.decoder import DeepseekV3

    return nnx.eval_shape(lambda: DeepseekV3(PRESETS["tiny"], nnx.Rngs(0)))


def test_a_weight_without_declared_axes_is_refused_by_name():
    """A weight created as a bare nnx.Param (no logical axes) stops the sharding with its path, never replicated."""
    from flax import nnx

    from jaxdp.layout import Layout
    from jaxdp.parallel.sharding import state_specs

    model = _tiny_abstract()
    model.dense_layers.attn.w_extra_DD = nnx.Param(jnp.zeros((1, 4, 4)))
    with pytest.raises(ValueError, match=r"\['dense_layers'\]\['attn'\]\['w_extra_DD'\]: it declares no logical axes"):
        state_specs(nnx.split(model)[1], Layout(dp=8))


def test_an_axis_no_rule_knows_or_two_axes_on_one_mesh_axis_are_refused():
    from flax import nnx

    from jaxdp.layout import Layout
    from jaxdp.model.layers import param
    from jaxdp.parallel.sharding import logical_spec, state_specs

    model = _tiny_abstract()
    model.w_odd = param(jnp.zeros((4, 4)), ("embed", "odd_axis"))
    with pytest.raises(ValueError, match=r"\['w_odd'\] declares the logical axis 'odd_axis'"):
        state_specs(nnx.split(model)[1], Layout(dp=8))
    with pytest.raises(ValueError, match="same mesh axis"):
        logical_spec(("expert_mlp", "vocab_out"), Layout(dp=8))
    with pytest.raises(ValueError, match="2 logical axes"):
        param(jnp.zeros((4, 4, 4)), ("embed", "heads"))


def test_stacked_weights_declare_the_layer_axis_first():
    """The stacks' weights carry "layers" in front of the axes their layer declared (nnx.vmap adds it)."""
    from jaxdp.model.layers import axes_of

    model = _tiny_abstract()
    assert axes_of(model.moe_layers.ffn.w_gate_up_ED2I) == (
        "layers", "experts", "embed", "gate_up", "expert_mlp")
    assert axes_of(model.dense_layers.ffn.w_down_FD) == ("layers", "dense_mlp", "embed")
    assert axes_of(model.moe_layers.ffn.shared.w_down_FD) == ("layers", "shared_mlp", "embed")
    assert axes_of(model.embed_VD) == ("vocab_in", "embed")
