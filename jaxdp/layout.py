"""Layout: how the devices of one model world are cut for attention, the MoE, dense layers and the LM head.

Two spellings give the same Layout: `--mesh dp=A,tp=B[,moe=tp|ep][,dense=tp|replicated]
[,lm_head=split|a2a|dp][,replicas=R]` (or a preset in jaxdp/meshes/), and SGLang's flags, where --tp-size is the
total and the others divide it (`--tp-size N --attn-dp-size A` is `dp=A,tp=N/A`). They compose: SGLang's
modifier flags add to --mesh what it leaves unsaid, as they add to --tp-size (`--mesh dp=8
--enable-dp-lm-head` is `dp=8,lm_head=dp`). Every mistake a user can make, a flag that contradicts the mesh
included, ends in a LayoutError whose message is one sentence that says what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

log = logging.getLogger("jaxdp.layout")

AXES = ("dp", "tp")
MESHES_DIR = Path(__file__).resolve().parent / "meshes"  # package data, so a wheel ships the presets too
SPEC_KEYS = ("dp", "tp", "moe", "dense", "lm_head", "replicas")
MOE_MODES = ("tp", "ep")
DENSE_MODES = ("tp", "replicated")
LM_HEAD_MODES = ("split", "a2a", "dp")
MEMORY_BALANCE = 0.9  # smallest free memory of a model world must be >= 90% of the largest (as SGLang)
GiB = 2**30
_HOST_COUNT_FLAG = "--xla_force_host_platform_device_count"


class LayoutError(ValueError):
    """A layout that cannot run as asked; the message is one sentence that says what to change."""


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1  # attention data-parallel groups (SGLang's --attn-dp-size)
    tp: int = 1  # devices per attention group (tensor-parallel attention inside a group)
    moe: str = "tp"  # "tp": every device a slice of every expert; "ep": whole experts per device
    dense_replicated: bool = False  # --moe-dense-tp-size 1: dense FFN layers whole on every device
    dp_lm_head: bool = False  # --enable-dp-lm-head: the whole LM head on every device
    replicas: int = 1  # --dp-size R: independent model copies, each its own mesh
    lm_head_a2a: bool = False  # vocab-split LM head, logits sent back by all-to-all when rows are equal

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value} is not a positive device count; give {name} 1 or more.")
        if self.moe not in MOE_MODES:
            raise LayoutError(f"moe={self.moe!r} is not a MoE layout; use moe=tp or moe=ep.")
        if self.dp_lm_head and self.lm_head_a2a:
            raise LayoutError("lm_head=dp and lm_head=a2a exclude each other; choose one of them.")
        if (self.dp_lm_head or self.lm_head_a2a) and self.dp == 1:
            which = "lm_head=dp (--enable-dp-lm-head)" if self.dp_lm_head else "lm_head=a2a"
            raise LayoutError(f"{which} needs attention DP but dp=1; use dp=2 or more (--attn-dp-size) "
                              "or drop it.")
        if self.replicas > 1 and self.dp > 1:
            raise LayoutError(
                f"replicas={self.replicas} (--dp-size, model copies) cannot be combined with attention DP "
                f"dp={self.dp}, as in SGLang; use one of them (--attn-dp-size if you meant attention groups)."
            )

    @property
    def world(self) -> int:
        """Devices of one model copy."""
        return self.dp * self.tp

    @property
    def total_devices(self) -> int:
        return self.world * self.replicas

    def spec(self) -> str:
        """The canonical --mesh text of this layout; `parse_mesh_spec(layout.spec()) == layout`."""
        lm_head = "dp" if self.dp_lm_head else "a2a" if self.lm_head_a2a else "split"
        dense = "replicated" if self.dense_replicated else "tp"
        text = f"dp={self.dp},tp={self.tp},moe={self.moe},dense={dense},lm_head={lm_head}"
        return text + (f",replicas={self.replicas}" if self.replicas > 1 else "")

    def describe(self) -> str:
        """One line for people, e.g. 'dp=8 x tp=1 attention groups, MoE ep over 8 devices, ...'."""
        devices = f"{self.world} device{'s' if self.world != 1 else ''}"
        dense = "replicated" if self.dense_replicated else "gathered" if self.dp > 1 else "tensor-parallel"
        head = "whole on every device" if self.dp_lm_head else "vocab-split"
        head += " with all-to-all" if self.lm_head_a2a else ""
        text = f"dp={self.dp} x tp={self.tp} attention groups, MoE {self.moe} over {devices}, "
        text += f"dense layers {dense}, LM head {head}"
        return f"{self.replicas} replicas, each {text}" if self.replicas > 1 else text

    def validate(self, num_devices: int | None = None, n_routed_experts: int | None = None,
                 num_heads: int | None = None) -> Layout:
        """Checks the layout against the devices and the model; returns self so calls can chain."""
        if num_devices is not None and self.total_devices > num_devices:
            raise LayoutError(f"the layout ({self.describe()}) needs {self.total_devices} devices but only "
                              f"{num_devices} exist; ask for at most {num_devices} (for example --mesh "
                              f"dp={num_devices}) or add devices.")
        if self.moe == "ep" and n_routed_experts is not None and n_routed_experts % self.world:
            raise LayoutError(f"moe=ep puts whole experts on each of the {self.world} devices, but "
                              f"{n_routed_experts} experts do not divide by {self.world}; use a device count "
                              f"that divides {n_routed_experts} or moe=tp.")
        if num_heads is not None and num_heads % self.tp:
            raise LayoutError(f"tp={self.tp} splits the attention heads, but {num_heads} heads do not divide "
                              f"by {self.tp}; use a tp that divides {num_heads} (and more dp instead).")
        return self

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        """The ("dp", "tp") mesh of one model copy; each tp group is a run of adjacent devices."""
        devs = list(jax.devices() if devices is None else devices)
        if self.replicas > 1 and len(devs) != self.world:
            raise LayoutError(f"this layout has {self.replicas} replicas, each its own mesh; use "
                              f"replica_meshes() or pass the {self.world} devices of one replica.")
        if len(devs) < self.world:
            raise LayoutError(f"the layout ({self.describe()}) needs {self.world} devices but {len(devs)} "
                              "were given; use a smaller mesh or give more devices.")
        grid = np.empty(self.world, dtype=object)
        grid[:] = devs[: self.world]
        return Mesh(grid.reshape(self.dp, self.tp), AXES, axis_types=(AxisType.Auto,) * 2)

    def replica_meshes(self, devices: Sequence[Any] | None = None) -> list[Mesh]:
        """One mesh per replica, each a contiguous run of `world` devices."""
        devs = list(jax.devices() if devices is None else devices)
        self.validate(num_devices=len(devs))
        one = dataclasses.replace(self, replicas=1)
        return [one.make_mesh(devs[r * self.world : (r + 1) * self.world]) for r in range(self.replicas)]

    def device_groups(self, devices: Sequence[Any] | None = None) -> list[list[Any]]:
        """The devices of each replica (one group per model world), in mesh order."""
        devs = list(jax.devices() if devices is None else devices)
        self.validate(num_devices=len(devs))
        return [devs[r * self.world : (r + 1) * self.world] for r in range(self.replicas)]

    def check_memory(self, devices: Sequence[Any] | None = None) -> None:
        """The memory balance check on the devices this layout uses; skipped where stats are unavailable."""
        groups = self.device_groups(devices)
        free = device_free_memory([d for group in groups for d in group])
        if free is not None:
            check_memory_balance(free, [[str(d) for d in group] for group in groups])


def check_redundant_experts(layout: Layout, n_routed_experts: int | None, num_redundant: int) -> None:
    """Refuse, in one sentence, `--ep-num-redundant-experts R` that this layout cannot hold: R only under moe=ep,
    and the E + R physical expert slots must split evenly over the layout's devices (n_routed_experts None: not
    checked yet)."""
    if isinstance(num_redundant, bool) or not isinstance(num_redundant, int) or num_redundant < 0:
        raise LayoutError(f"--ep-num-redundant-experts {num_redundant} is not a count; give 0 or more.")
    if num_redundant and layout.moe != "ep":
        raise LayoutError(f"--ep-num-redundant-experts {num_redundant} needs expert parallelism, but the MoE is "
                          f"moe={layout.moe}; add moe=ep to --mesh or drop the flag.")
    if num_redundant and n_routed_experts is not None and (n_routed_experts + num_redundant) % layout.world:
        raise LayoutError(f"--ep-num-redundant-experts {num_redundant} gives {n_routed_experts + num_redundant} "
                          f"expert slots, which do not split over {layout.world} devices; give a count that makes "
                          f"{n_routed_experts} + R a multiple of {layout.world}.")


def check_expert_location_flags(layout: Layout, num_redundant: int, location: str | None) -> None:
    """The EPLB flags' checks that need no model (before anything loads): R a count, only under moe=ep, and an
    --init-expert-location file that exists; the slots' split over the devices is checked at load."""
    check_redundant_experts(layout, None, num_redundant)
    if location and layout.moe != "ep":
        raise LayoutError(f"--init-expert-location places experts under expert parallelism, but the MoE is "
                          f"moe={layout.moe}; add moe=ep to --mesh or drop the flag.")
    if location and not Path(location).is_file():
        raise LayoutError(f"--init-expert-location {location} is not a file; give a placement or recorded load "
                          f"file (.json or .npz).")


def available_presets() -> list[str]:
    return sorted(p.stem for p in MESHES_DIR.glob("*.toml"))


def parse_mesh_spec(text: str, num_devices: int | None = None) -> Layout:
    """`dp=A,tp=B[,...]`, a preset name from jaxdp/meshes/, or a .toml path -> Layout.

    `num_devices` resolves `dp = "all"` (or `tp = "all"`) in presets; without it JAX's device count is used.
    """
    return _layout_from_items(*_read_mesh(text), num_devices)


def _read_mesh(text: str) -> tuple[dict[str, Any], str]:
    """--mesh text -> (the keys it gives, how to name it in a message)."""
    text = text.strip()
    if not text:
        raise LayoutError(f"--mesh is empty; give dp=A,tp=B (for example dp=8) or one of {_preset_list()}.")
    if "=" not in text:
        return _read_preset(text)
    items: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise LayoutError(f"--mesh {text}: {part.strip()!r} is not key=value; write for example "
                              "dp=2,tp=4.")
        if key in items:
            raise LayoutError(f"--mesh {text} gives {key} twice; give each key once.")
        items[key] = value
    return items, f"--mesh {text}"


def _read_preset(name: str) -> tuple[dict[str, Any], str]:
    if name.endswith(".toml") or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise LayoutError(f"mesh file {path} does not exist; give an existing .toml file or a preset.")
    else:
        path = MESHES_DIR / f"{name}.toml"
        if not path.is_file():
            raise LayoutError(f"unknown mesh preset {name!r}; use one of {_preset_list()} or dp=A,tp=B.")
    try:
        items = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise LayoutError(f"{path} is not valid TOML ({e}); fix the file.") from None
    return items, f"--mesh {name}" if path.parent == MESHES_DIR else str(path)


def _preset_list() -> str:
    return ", ".join(available_presets()) or f"(none in {MESHES_DIR})"


def _layout_from_items(items: dict[str, Any], where: str, num_devices: int | None) -> Layout:
    unknown = [k for k in items if k not in SPEC_KEYS]
    if unknown:
        raise LayoutError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(SPEC_KEYS)}.")
    sizes = {k: _size(items.get(k, 1), k, where) for k in ("dp", "tp", "replicas")}
    alls = [k for k, v in sizes.items() if v == "all"]
    if alls:
        if alls != ["dp"] and alls != ["tp"]:
            raise LayoutError(f"{where}: only one of dp or tp can be \"all\"; give the other a number.")
        n = jax.device_count() if num_devices is None else num_devices
        other = sizes["tp" if alls == ["dp"] else "dp"] * sizes["replicas"]
        sizes[alls[0]] = n // other
        if sizes[alls[0]] < 1:
            raise LayoutError(f"{where} scales {alls[0]} to {n} devices, too few; use a smaller tp.")
        log.info("%s: %s = all -> %d (%d devices)", where, alls[0], sizes[alls[0]], n)
    moe = _choice(items, "moe", MOE_MODES, where)
    dense = _choice(items, "dense", DENSE_MODES, where)
    lm_head = _choice(items, "lm_head", LM_HEAD_MODES, where)
    if alls and lm_head in ("dp", "a2a") and sizes["dp"] == 1:
        raise LayoutError(
            f"{where} scales dp to the {n} device(s) present, but lm_head={lm_head} needs 2 or more; on a "
            f"CPU-only machine set XLA_FLAGS={_HOST_COUNT_FLAG}=8 or write out "
            f"dp=8,moe={moe},dense={dense},lm_head={lm_head}."
        )
    return Layout(
        dp=sizes["dp"], tp=sizes["tp"], replicas=sizes["replicas"], moe=moe,
        dense_replicated=dense == "replicated", dp_lm_head=lm_head == "dp", lm_head_a2a=lm_head == "a2a",
    )


def _size(value: Any, key: str, where: str) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "all" and key in ("dp", "tp"):
        return "all"
    text = str(value).strip()
    if not text.lstrip("-").isdigit():  # refuses TOML floats and booleans too
        raise LayoutError(f"{where}: {key}={value} is not a whole number; write for example {key}=2.")
    if int(text) < 1:
        raise LayoutError(f"{where}: {key}={text} is not a positive device count; give {key} 1 or more.")
    return int(text)


def _choice(items: dict[str, Any], key: str, choices: tuple[str, ...], where: str) -> str:
    value = str(items.get(key, choices[0])).strip().lower()
    if value not in choices:
        options = " or ".join(f"{key}={c}" for c in choices)
        raise LayoutError(f"{where}: {key}={items[key]} is not known; use {options}.")
    return value


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    """Adds --mesh and the SGLang-style layout flags (either spelling, or --mesh with flags that add to it)."""
    g = parser.add_argument_group("layout", "--mesh and/or SGLang's flags (--tp-size is the total); with --mesh, "
                                  "--moe-a2a-backend, --moe-dense-tp-size and --enable-dp-lm-head add to it")
    g.add_argument("--mesh", default=None, metavar="SPEC",
                   help="dp=A,tp=B[,moe=tp|ep][,dense=tp|replicated][,lm_head=split|a2a|dp][,replicas=R], "
                        f"or a preset from meshes/ ({_preset_list()}), or a path to a .toml file")
    g.add_argument("--tp-size", "--tp", type=int, default=None, metavar="N",
                   help="devices of one model copy; the other flags divide it (default 1)")
    g.add_argument("--attn-dp-size", type=int, default=None, metavar="A",
                   help="attention data-parallel groups: A groups of N/A devices, each with its own requests "
                        "and KV cache (default 1)")
    g.add_argument("--dp-size", "--dp", type=int, default=None, metavar="R",
                   help="model copies (replicas), each its own mesh and pools; cannot be combined with "
                        "--attn-dp-size (default 1)")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="deprecated: --dp-size A --enable-dp-attention is the old --attn-dp-size A")
    g.add_argument("--moe-a2a-backend", default=None, metavar="NAME",
                   help="none (default): MoE tensor-parallel; any backend (deepep, mooncake, ...): expert "
                        "parallel over all N devices")
    g.add_argument("--moe-dense-tp-size", type=int, default=None, metavar="1",
                   help="1: the dense FFN layers whole on every device instead of gathered")
    g.add_argument("--enable-dp-lm-head", action="store_true",
                   help="the whole LM head on every device, no communication (needs --attn-dp-size > 1)")


def layout_from_args(args: argparse.Namespace, num_devices: int | None = None) -> Layout:
    """--mesh and/or the SGLang flags -> Layout; validated against `num_devices` when given.

    With --mesh, the modifier flags (--moe-a2a-backend, --moe-dense-tp-size, --enable-dp-lm-head) fill in
    what the mesh leaves unsaid, and the size flags (--tp-size, --attn-dp-size, --dp-size) must agree with
    it; only a flag that contradicts the mesh is an error.
    """
    mesh = getattr(args, "mesh", None)
    sizes = _flag_sizes(args, mesh)
    if mesh is None:
        total = sizes.get("world", 1)
        layout = Layout(dp=sizes.get("dp", 1), tp=total // sizes.get("dp", 1), replicas=sizes.get("replicas", 1))
        modifiers = {k: value for k, (value, _) in _flag_modifiers(args, layout.world).items()}
        layout = _layout_from_items(_items(layout) | modifiers, "the flags", None)
    else:
        items, where = _read_mesh(mesh)
        base = _layout_from_items(items, where, num_devices)
        for key, (value, flag) in _flag_modifiers(args, base.world).items():
            if key in items and str(items[key]).strip().lower() != value:
                raise LayoutError(f"{flag} asks for {key}={value}, which contradicts {where} ({key}={items[key]}); "
                                  "give only one of them.")
            items = {**items, key: value}
        layout = _layout_from_items({**items, **{k: getattr(base, k) for k in ("dp", "tp", "replicas")}}, where,
                                    num_devices)
        for key, (what, flag) in _SIZE_FLAGS.items():
            if key in sizes and sizes[key] != getattr(layout, key):
                raise LayoutError(f"{flag} {sizes[key]} contradicts {where} ({what}: {getattr(layout, key)}); "
                                  "give only one of them or make them agree.")
    return layout.validate(num_devices) if num_devices is not None else layout


# size flag -> (what it counts, the flag), checked against --mesh
_SIZE_FLAGS = {"world": ("devices per model copy", "--tp-size"), "dp": ("attention DP groups", "--attn-dp-size"),
               "replicas": ("model copies", "--dp-size")}


def _items(layout: Layout) -> dict[str, Any]:
    return {"dp": layout.dp, "tp": layout.tp, "replicas": layout.replicas}


def _flag_sizes(args: argparse.Namespace, mesh: str | None) -> dict[str, int]:
    """The sizes the SGLang flags give (only those given): world (--tp-size), dp (--attn-dp-size, or the
    deprecated --dp-size A --enable-dp-attention), replicas (--dp-size)."""
    tp_size = getattr(args, "tp_size", None)
    attn = getattr(args, "attn_dp_size", None)
    dp_size = getattr(args, "dp_size", None)
    for flag, value in (("--tp-size", tp_size), ("--attn-dp-size", attn), ("--dp-size", dp_size),
                        ("--moe-dense-tp-size", getattr(args, "moe_dense_tp_size", None))):
        if value is not None and value < 1:
            raise LayoutError(f"{flag} {value} is not a positive number; give {flag} 1 or more.")
    replicas = dp_size
    if getattr(args, "enable_dp_attention", False):
        if dp_size is None and attn is None and mesh is None:
            raise LayoutError("--enable-dp-attention needs a group count; write --attn-dp-size A instead.")
        if dp_size is not None:
            if attn is not None and attn != dp_size:
                raise LayoutError(f"--dp-size {dp_size} --enable-dp-attention conflicts with --attn-dp-size "
                                  f"{attn}; keep only --attn-dp-size.")
            log.warning("--dp-size %d --enable-dp-attention is deprecated; write --attn-dp-size %d instead",
                        dp_size, dp_size)
            attn, replicas = dp_size, None
        else:
            log.warning("--enable-dp-attention is deprecated and redundant with --attn-dp-size; drop it")
    if (replicas or 1) > 1 and (attn or 1) > 1:
        raise LayoutError(f"--dp-size {replicas} (model copies) cannot be combined with --attn-dp-size "
                          f"{attn} (attention groups), as in SGLang; use one of them.")
    if mesh is None and (tp_size or 1) % (attn or 1):
        tp_size = tp_size or 1
        divisors = ", ".join(str(d) for d in range(1, tp_size + 1) if tp_size % d == 0)
        raise LayoutError(
            f"--attn-dp-size {attn} does not divide --tp-size {tp_size} (the devices of one model copy); "
            f"use an attention DP size that divides {tp_size}: {divisors}."
        )
    given = {"world": tp_size, "dp": attn, "replicas": replicas}
    return {k: v for k, v in given.items() if v is not None}


def _flag_modifiers(args: argparse.Namespace, world: int) -> dict[str, tuple[str, str]]:
    """The --mesh keys the modifier flags set (key -> (value, the flag as given)), for a model copy of
    `world` devices."""
    out: dict[str, tuple[str, str]] = {}
    backend = getattr(args, "moe_a2a_backend", None)
    if backend is not None:
        out["moe"] = ("tp" if backend.strip().lower() == "none" else "ep", f"--moe-a2a-backend {backend}")
    dense_tp = getattr(args, "moe_dense_tp_size", None)
    if dense_tp is not None:
        if dense_tp not in (1, world):
            raise LayoutError(f"--moe-dense-tp-size {dense_tp} is not supported; use 1 (dense layers whole on "
                              "every device) or leave it unset.")
        out["dense"] = ("replicated" if dense_tp == 1 else "tp", f"--moe-dense-tp-size {dense_tp}")
    if getattr(args, "enable_dp_lm_head", False):
        out["lm_head"] = ("dp", "--enable-dp-lm-head")
    return out


def ensure_host_devices(n: int) -> None:
    """At least `n` JAX devices: before JAX initialises its backends, sets the host platform's device count
    (`jax_num_cpu_devices`; it only affects the CPU platform, harmless elsewhere; a larger count already asked
    for through XLA_FLAGS is kept); afterwards only checks, raising LayoutError if short. The environment is
    not touched."""
    found = re.search(rf"{_HOST_COUNT_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    want = max(n, jax.config.jax_num_cpu_devices, int(found.group(1)) if found else 0)
    try:
        jax.config.update("jax_num_cpu_devices", want)
    except RuntimeError:  # JAX has started its backends: the device count is what it is
        have = jax.device_count()
        if have < n:
            raise LayoutError(f"JAX has already started with {have} devices, fewer than the {n} this layout "
                              f"needs; call ensure_host_devices({n}) before JAX starts or set "
                              f"XLA_FLAGS={_HOST_COUNT_FLAG}={n}.") from None


def device_free_memory(devices: Sequence[Any]) -> dict[str, int] | None:
    """Free bytes per device ("cuda:0" -> bytes) from `memory_stats()`; None where unavailable (CPU).

    Free is JAX's allocator bytes_limit - bytes_in_use; other processes show only where they limited it.
    """
    free: dict[str, int] = {}
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some platforms raise instead of returning None
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        free[str(device)] = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return free


def check_memory_balance(
    free_bytes_by_device: dict[str, int], groups: list[list[str]], ratio: float = MEMORY_BALANCE
) -> None:
    """Within each group (one model world) the smallest free memory must be >= `ratio` of the largest.

    All devices of a model world hold the same share, so the smallest sets the size for all (the guide's
    two-L4 story). Replicas size their own pools: each is its own group. Unknown devices are skipped.
    """
    for group in groups:
        known = [(name, free_bytes_by_device[name]) for name in group if name in free_bytes_by_device]
        if len(known) < 2:
            continue
        low_name, low = min(known, key=lambda item: item[1])
        high_name, high = max(known, key=lambda item: item[1])
        if low < ratio * high:
            raise LayoutError(
                f"device {low_name} has {low / GiB:.2f} GiB free, below {ratio:.0%} of {high_name}'s "
                f"{high / GiB:.2f} GiB; the devices of one model copy all size their memory to the smallest, "
                "so free the GPU or use whole GPUs for one model copy."
            )
