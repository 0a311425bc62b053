"""Layout: --mesh text, SGLang flags, presets, validation messages, meshes and the memory balance check."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType

from jaxdp import layout as layout_mod
from jaxdp.layout import (
    MESHES_DIR,
    Layout,
    LayoutError,
    add_layout_args,
    available_presets,
    check_memory_balance,
    device_free_memory,
    ensure_host_devices,
    layout_from_args,
    parse_mesh_spec,
)

GiB = 2**30
PRESETS = ("tp8", "dp8", "dp2-tp4", "dp8-ep8", "dp4", "decode-ep")


def flags(text: str, num_devices: int | None = None) -> Layout:
    parser = argparse.ArgumentParser(prog="serve")
    add_layout_args(parser)
    return layout_from_args(parser.parse_args(text.split()), num_devices=num_devices)


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith("."), message
    assert ". " not in message[:-1], f"more than one sentence: {message}"
    assert "Traceback" not in message


# ------------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("dp=8", Layout(dp=8, tp=1)),
        ("tp=8", Layout(dp=1, tp=8)),
        ("dp=2,tp=4", Layout(dp=2, tp=4)),
        (" dp = 2 , tp = 4 ", Layout(dp=2, tp=4)),
        ("tp=4,dp=2,moe=ep", Layout(dp=2, tp=4, moe="ep")),
        ("dp=8,moe=EP,dense=replicated,lm_head=dp",
         Layout(dp=8, moe="ep", dense_replicated=True, dp_lm_head=True)),
        ("dp=4,lm_head=a2a", Layout(dp=4, lm_head_a2a=True)),
        ("dp=4,lm_head=split,dense=tp,moe=tp", Layout(dp=4)),
        ("tp=4,replicas=2", Layout(tp=4, replicas=2)),
    ],
)
def test_parse_mesh_spec(spec, expected):
    assert parse_mesh_spec(spec) == expected


def test_layout_properties():
    l = parse_mesh_spec("dp=2,tp=4")
    assert (l.dp, l.tp, l.world, l.total_devices, l.replicas) == (2, 4, 8, 8, 1)
    r = parse_mesh_spec("tp=2,replicas=3")
    assert (r.world, r.total_devices) == (2, 6)


@pytest.mark.parametrize(
    "spec",
    ["dp=8", "tp=8", "dp=2,tp=4,moe=ep", "dp=8,moe=ep,dense=replicated,lm_head=dp", "dp=4,lm_head=a2a",
     "tp=4,replicas=2"],
)
def test_spec_round_trip(spec):
    l = parse_mesh_spec(spec)
    assert parse_mesh_spec(l.spec()) == l


def test_describe():
    assert parse_mesh_spec("dp=8,moe=ep").describe() == (
        "dp=8 x tp=1 attention groups, MoE ep over 8 devices, dense layers gathered, LM head vocab-split"
    )
    assert "whole on every device" in parse_mesh_spec("decode-ep", num_devices=8).describe()
    assert parse_mesh_spec("tp=4,replicas=2").describe().startswith("2 replicas, each dp=1 x tp=4")


# ------------------------------------------------------------------------------------------- SGLang flags


@pytest.mark.parametrize(
    "argv, spec",
    [
        ("--tp-size 8 --attn-dp-size 2", "dp=2,tp=4"),
        ("--tp 8 --attn-dp-size 8", "dp=8"),
        ("--tp 8", "tp=8"),
        ("--tp 4 --attn-dp-size 4", "dp4"),
        ("--tp 8 --attn-dp-size 8 --moe-a2a-backend deepep", "dp8-ep8"),
        ("--tp 8 --attn-dp-size 8 --moe-a2a-backend mooncake", "dp=8,moe=ep"),
        ("--tp 8 --attn-dp-size 8 --moe-a2a-backend none", "dp=8,moe=tp"),
        ("--tp 8 --attn-dp-size 2 --enable-dp-lm-head", "dp=2,tp=4,lm_head=dp"),
        ("--tp 8 --attn-dp-size 8 --moe-dense-tp-size 8", "dp=8"),
        ("--tp-size 4 --dp-size 2", "tp=4,replicas=2"),
        ("", "dp=1,tp=1"),
    ],
)
def test_flags_match_mesh_spec(argv, spec):
    assert flags(argv) == parse_mesh_spec(spec)


def test_flags_decode_server_matches_scaled_preset():
    argv = "--tp 16 --attn-dp-size 16 --moe-a2a-backend deepep --moe-dense-tp-size 1 --enable-dp-lm-head"
    assert flags(argv) == parse_mesh_spec("decode-ep", num_devices=16)
    assert flags(argv).dense_replicated and flags(argv).dp_lm_head and flags(argv).moe == "ep"


def test_deprecated_spelling_warns(caplog):
    caplog.set_level(logging.WARNING, logger="jaxdp.layout")
    assert flags("--tp 8 --dp-size 8 --enable-dp-attention") == parse_mesh_spec("dp=8")
    warnings = [r for r in caplog.records if r.name == "jaxdp.layout" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--attn-dp-size 8" in warnings[0].getMessage()


def test_new_spelling_does_not_warn(caplog):
    caplog.set_level(logging.WARNING, logger="jaxdp.layout")
    flags("--tp 8 --attn-dp-size 8")
    assert not [r for r in caplog.records if r.name == "jaxdp.layout"]


def test_mesh_and_agreeing_flags_are_accepted():
    assert flags("--mesh dp=2,tp=4 --tp 8 --attn-dp-size 2") == Layout(dp=2, tp=4)


@pytest.mark.parametrize(
    "argv, spec",
    [  # SGLang's modifier flags add to --mesh what it leaves unsaid, as they add to --tp-size
        ("--mesh dp=8 --enable-dp-lm-head", "dp=8,lm_head=dp"),
        ("--mesh dp=8 --moe-dense-tp-size 1", "dp=8,dense=replicated"),
        ("--mesh dp=8 --moe-dense-tp-size 8", "dp=8,dense=tp"),
        ("--mesh dp=8 --moe-a2a-backend deepep", "dp=8,moe=ep"),
        ("--mesh dp=8 --moe-a2a-backend none", "dp=8"),
        ("--mesh dp=8 --moe-a2a-backend deepep --moe-dense-tp-size 1 --enable-dp-lm-head",
         "dp=8,moe=ep,dense=replicated,lm_head=dp"),
        ("--mesh dp=2,tp=4 --tp 8 --attn-dp-size 2 --enable-dp-lm-head", "dp=2,tp=4,lm_head=dp"),
        ("--mesh dp=8,moe=ep --moe-a2a-backend mooncake", "dp=8,moe=ep"),  # saying the same twice is fine
        ("--mesh dp=8,lm_head=dp --enable-dp-lm-head", "dp=8,lm_head=dp"),
        ("--mesh dp4 --enable-dp-lm-head", "dp=4,lm_head=dp"),  # a preset
        ("--mesh dp=8 --tp-size 8 --attn-dp-size 8 --enable-dp-attention", "dp=8"),
        ("--mesh tp=4,replicas=2 --dp-size 2 --moe-a2a-backend deepep", "tp=4,replicas=2,moe=ep"),
    ],
)
def test_modifier_flags_compose_with_mesh(argv, spec):
    assert flags(argv) == parse_mesh_spec(spec)
    assert flags(argv, num_devices=8) == parse_mesh_spec(spec)


def test_modifier_flags_compose_with_a_scaled_preset():
    assert flags("--mesh dp8-ep8 --moe-dense-tp-size 1 --enable-dp-lm-head", num_devices=8) == parse_mesh_spec(
        "dp=8,moe=ep,dense=replicated,lm_head=dp")
    layout = flags("--mesh decode-ep --moe-a2a-backend deepep --tp-size 16", num_devices=16)
    assert layout == parse_mesh_spec("decode-ep", num_devices=16) and layout.world == 16


@pytest.mark.parametrize(
    "argv, words",
    [  # only a real contradiction is an error
        ("--mesh dp=8 --attn-dp-size 4", "--attn-dp-size 4 contradicts --mesh dp=8 (attention DP groups: 8)"),
        ("--mesh dp=8 --tp-size 4", "--tp-size 4 contradicts --mesh dp=8 (devices per model copy: 8)"),
        ("--mesh dp=8 --dp-size 2", "--dp-size 2 contradicts --mesh dp=8 (model copies: 1)"),
        ("--mesh dp=8,moe=tp --moe-a2a-backend deepep", "moe=ep, which contradicts --mesh dp=8,moe=tp (moe=tp)"),
        ("--mesh dp=8,moe=ep --moe-a2a-backend none", "contradicts --mesh dp=8,moe=ep"),
        ("--mesh dp=8,dense=tp --moe-dense-tp-size 1", "dense=replicated, which contradicts"),
        ("--mesh dp=8,lm_head=a2a --enable-dp-lm-head", "lm_head=dp, which contradicts"),
        ("--mesh dp8-ep8 --moe-a2a-backend none", "contradicts --mesh dp8-ep8"),
        ("--mesh tp=8 --enable-dp-lm-head", "needs attention DP but dp=1"),
        ("--mesh dp=8 --moe-dense-tp-size 4", "use 1"),
    ],
)
def test_flags_that_contradict_the_mesh_are_one_sentence(argv, words):
    with pytest.raises(LayoutError) as info:
        flags(argv)
    assert_one_sentence(str(info.value))
    assert words in str(info.value)


def test_layout_from_args_validates_against_devices():
    assert flags("--mesh dp=8", num_devices=8) == Layout(dp=8)
    with pytest.raises(LayoutError, match="only 4 exist"):
        flags("--mesh dp=8", num_devices=4)


def test_help_mentions_every_flag():
    parser = argparse.ArgumentParser(prog="serve")
    add_layout_args(parser)
    text = parser.format_help()
    for flag in ("--mesh", "--tp-size", "--attn-dp-size", "--dp-size", "--enable-dp-attention",
                 "--moe-a2a-backend", "--moe-dense-tp-size", "--enable-dp-lm-head", "dp8-ep8"):
        assert flag in text


# ----------------------------------------------------------------------------------------------- errors


ERRORS = [
    # (what the user did, a word of the fix the message must contain)
    (lambda: flags("--tp-size 8 --attn-dp-size 3"), "divides 8: 1, 2, 4, 8"),
    (lambda: parse_mesh_spec("dp=16").validate(8), "at most 8"),
    (lambda: parse_mesh_spec("dp=8,moe=ep").validate(8, n_routed_experts=12), "moe=tp"),
    (lambda: parse_mesh_spec("tp=8").validate(8, num_heads=4), "tp that divides 4"),
    (lambda: parse_mesh_spec("tp=8,lm_head=dp"), "--attn-dp-size"),
    (lambda: parse_mesh_spec("tp=8,lm_head=a2a"), "dp=2 or more"),
    (lambda: flags("--tp 8 --enable-dp-lm-head"), "--attn-dp-size"),
    (lambda: parse_mesh_spec("dp=0"), "1 or more"),
    (lambda: parse_mesh_spec("dp=2,tp=-4"), "1 or more"),
    (lambda: flags("--tp-size 0"), "1 or more"),
    (lambda: flags("--tp 8 --attn-dp-size -1"), "1 or more"),
    (lambda: Layout(dp=0), "1 or more"),
    (lambda: parse_mesh_spec("dp=two"), "dp=2"),
    (lambda: parse_mesh_spec("dp=2.5"), "dp=2"),
    (lambda: parse_mesh_spec("dp=2,foo=1"), "the keys are dp, tp, moe, dense, lm_head, replicas"),
    (lambda: parse_mesh_spec("dp=2,moe=fast"), "moe=tp or moe=ep"),
    (lambda: parse_mesh_spec("dp=2,dense=yes"), "dense=tp or dense=replicated"),
    (lambda: parse_mesh_spec("dp=2,lm_head=x"), "lm_head=split or lm_head=a2a or lm_head=dp"),
    (lambda: parse_mesh_spec("dp=2,dp=4"), "once"),
    (lambda: parse_mesh_spec("dp=2,,tp=4"), "dp=2,tp=4"),
    (lambda: parse_mesh_spec(""), "dp=A,tp=B"),
    (lambda: parse_mesh_spec("dp16"), "dp2-tp4, dp4, dp8, dp8-ep8"),
    (lambda: parse_mesh_spec("/nonexistent/x.toml"), "existing .toml"),
    (lambda: flags("--tp 8 --dp-size 2 --attn-dp-size 4"), "use one of them"),
    (lambda: parse_mesh_spec("dp=2,replicas=2"), "use one of them"),
    (lambda: flags("--tp 8 --dp-size 8 --enable-dp-attention --attn-dp-size 4"), "keep only --attn-dp-size"),
    (lambda: flags("--tp 8 --enable-dp-attention"), "--attn-dp-size A"),
    (lambda: flags("--tp 8 --attn-dp-size 8 --moe-dense-tp-size 2"), "use 1"),
    (lambda: flags("--mesh dp=8 --tp-size 4"), "give only one of them"),
    (lambda: parse_mesh_spec("decode-ep", num_devices=1), "XLA_FLAGS"),
    (lambda: parse_mesh_spec("tp=4,replicas=2").make_mesh(), "replica_meshes()"),
    (lambda: parse_mesh_spec("dp=4").make_mesh(jax.devices()[:2]), "give more devices"),
    (lambda: ensure_host_devices(len(jax.devices()) * 2), "ensure_host_devices"),
]


@pytest.mark.parametrize("make, fix", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors_are_one_sentence_with_the_fix(make, fix):
    with pytest.raises(LayoutError) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert_one_sentence(str(info.value))
    assert fix in str(info.value)


# ---------------------------------------------------------------------------------------------- presets


def test_presets_exist_and_explain_themselves():
    assert set(PRESETS) <= set(available_presets())
    for name in PRESETS:
        first = (MESHES_DIR / f"{name}.toml").read_text().splitlines()[0]
        assert first.startswith("# ") and len(first) > 20, name


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tp8", Layout(tp=8)),
        ("dp8", Layout(dp=8)),
        ("dp2-tp4", Layout(dp=2, tp=4)),
        ("dp8-ep8", Layout(dp=8, moe="ep")),
        ("dp4", Layout(dp=4)),
    ],
)
def test_presets_load(name, expected):
    assert parse_mesh_spec(name) == expected
    assert flags(f"--mesh {name}") == expected
    assert parse_mesh_spec(str(MESHES_DIR / f"{name}.toml")) == expected


@pytest.mark.parametrize("num_devices, dp", [(16, 16), (8, 8), (4, 4), (None, 8)])
def test_decode_preset_scales_to_the_devices(num_devices, dp):
    expected = Layout(dp=dp, moe="ep", dense_replicated=True, dp_lm_head=True)
    assert parse_mesh_spec("decode-ep", num_devices=num_devices) == expected


def test_preset_file_with_unknown_key(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text('# a typo\ndp = 4\nexperts = "ep"\n')
    with pytest.raises(LayoutError, match="unknown key 'experts'") as info:
        parse_mesh_spec(str(path))
    assert_one_sentence(str(info.value))


# ----------------------------------------------------------------------------------------------- meshes


def ids(mesh) -> list[list[int]]:
    return [[d.id for d in row] for row in mesh.devices]


@pytest.mark.parametrize(
    "spec, rows",
    [
        ("dp=2,tp=4", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("dp=8", [[i] for i in range(8)]),
        ("tp=8", [list(range(8))]),
        ("dp=4,tp=2", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("dp=2", [[0], [1]]),
    ],
)
def test_make_mesh_contiguous_tp_groups(spec, rows):
    l = parse_mesh_spec(spec)
    mesh = l.make_mesh()
    assert mesh.axis_names == ("dp", "tp")
    assert dict(mesh.shape) == {"dp": l.dp, "tp": l.tp}
    assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert ids(mesh) == rows


def test_make_mesh_keeps_given_order():
    devices = list(reversed(jax.devices()))
    assert ids(parse_mesh_spec("dp=2,tp=4").make_mesh(devices)) == [[7, 6, 5, 4], [3, 2, 1, 0]]


def test_replica_meshes():
    meshes = parse_mesh_spec("tp=4,replicas=2").replica_meshes()
    assert [ids(m) for m in meshes] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert all(dict(m.shape) == {"dp": 1, "tp": 4} for m in meshes)
    assert [ids(m) for m in parse_mesh_spec("tp=2,replicas=4").replica_meshes()][3] == [[6, 7]]
    assert len(parse_mesh_spec("dp=8").replica_meshes()) == 1
    with pytest.raises(LayoutError, match="only 8 exist"):
        parse_mesh_spec("tp=4,replicas=3").replica_meshes()


def test_ensure_host_devices_after_start_checks_only():
    ensure_host_devices(len(jax.devices()))  # enough: nothing happens


def test_ensure_host_devices_before_start_sets_the_count():
    """In a fresh interpreter: the count is set through JAX's config (XLA_FLAGS is left as it was), a larger
    count already in XLA_FLAGS is kept, and once JAX has started only a check is left."""
    import subprocess
    import sys

    code = ("import os, jax; from jaxdp.layout import ensure_host_devices, LayoutError; ensure_host_devices({n}); "
            "print(jax.device_count(), os.environ.get('XLA_FLAGS', ''));\n"
            "try: ensure_host_devices(64)\n"
            "except LayoutError as e: print('refused', 'ensure_host_devices(64)' in str(e))")
    env = {k: v for k, v in layout_mod.os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    for n, flags, expect in ((6, None, "6 "), (4, "--xla_force_host_platform_device_count=8",
                                               "8 --xla_force_host_platform_device_count=8")):
        run_env = env if flags is None else env | {"XLA_FLAGS": flags}
        out = subprocess.run([sys.executable, "-c", code.format(n=n)], env=run_env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == [expect, "refused True"], out.stdout


# ----------------------------------------------------------------------------------------------- memory


def test_memory_check_guide_example():
    free = {"cuda:0": int(21.70391845703125 * GiB), "cuda:1": int(18.28375244140625 * GiB)}
    with pytest.raises(LayoutError) as info:
        check_memory_balance(free, [["cuda:0", "cuda:1"]])
    message = str(info.value)
    assert_one_sentence(message)
    for part in ("cuda:1", "18.28 GiB", "cuda:0's 21.70 GiB", "90%", "free the GPU", "whole GPUs"):
        assert part in message


@pytest.mark.parametrize(
    "free_gib, groups",
    [
        ({"a": 20.0, "b": 20.0}, [["a", "b"]]),
        ({"a": 20.0, "b": 18.01}, [["a", "b"]]),  # just above 90%
        # replicas size their own pools
        ({"a": 20.0, "b": 20.0, "c": 3.0, "d": 3.1}, [["a", "b"], ["c", "d"]]),
        ({"a": 20.0, "b": 3.0}, [["a"], ["b"]]),  # the guide's --dp-size 2 pair starts
        ({"a": 20.0}, [["a", "b"]]),  # unknown devices are skipped
    ],
)
def test_memory_check_passes(free_gib, groups):
    check_memory_balance({k: int(v * GiB) for k, v in free_gib.items()}, groups)


def test_memory_check_each_group_on_its_own():
    free = {k: int(v * GiB) for k, v in {"a": 20.0, "b": 20.0, "c": 10.0, "d": 5.0}.items()}
    with pytest.raises(LayoutError, match="device d has 5.00 GiB free, below 90% of c's 10.00 GiB"):
        check_memory_balance(free, [["a", "b"], ["c", "d"]])


def test_device_free_memory_on_cpu_is_unavailable():
    assert device_free_memory(jax.devices()) is None
    parse_mesh_spec("dp=8").check_memory()  # skipped, no error


class FakeDevice:
    def __init__(self, name: str, limit: int, used: int):
        self.name, self.limit, self.used = name, limit, used

    def __str__(self) -> str:
        return self.name

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": self.used}


def test_device_free_memory_and_layout_check_with_stats():
    devices = [FakeDevice("cuda:0", 20 * GiB, 0), FakeDevice("cuda:1", 20 * GiB, 0),
               FakeDevice("cuda:2", 20 * GiB, 1 * GiB), FakeDevice("cuda:3", 20 * GiB, 10 * GiB)]
    assert device_free_memory(devices) == {"cuda:0": 20 * GiB, "cuda:1": 20 * GiB, "cuda:2": 19 * GiB,
                                           "cuda:3": 10 * GiB}
    parse_mesh_spec("tp=2,replicas=2").check_memory(devices[:2] + devices[:2][::-1])
    with pytest.raises(LayoutError, match="device cuda:3 has 10.00 GiB free"):
        parse_mesh_spec("tp=4").check_memory(devices)
    with pytest.raises(LayoutError, match="cuda:3"):
        parse_mesh_spec("tp=2,replicas=2").check_memory(devices)
    parse_mesh_spec("tp=3").check_memory(devices)  # cuda:3 is not used


def test_a_parameter_without_a_sharding_rule_fails_loudly():
    """A new weight must say where it lives: one created without its logical axes is refused, never silently
    replicated."""
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from jaxdp.config import PRESETS
    from jaxdp.model.decoder import DeepseekV3
    from jaxdp.parallel.sharding import param_spec, state_specs

    model = nnx.eval_shape(lambda: DeepseekV3(PRESETS["tiny"], nnx.Rngs(0)))
    model.moe_layers.ffn.w_new_XY = nnx.Param(jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"no sharding rule for the parameter .*w_new_XY"):
        state_specs(nnx.split(model)[1], Layout(dp=8))
    assert param_spec("['embed_VD']", model.embed_VD, Layout(dp=8)) == P()
    assert param_spec("['lm_head_DV']", model.lm_head_DV, Layout(dp=8)) == P(None, ("dp", "tp"))
