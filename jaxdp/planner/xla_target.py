"""The compiler `plan --compile` runs: XLA:GPU for a named GPU, or XLA:CPU on host devices.

XLA:GPU needs no GPU: with the CUDA plugin's two wheels installed (`jax-cuda12-plugin` and
`jax-cuda12-pjrt` at JAX's own version; `pip install "jaxdp[xla-gpu]"`), a GPU target description (an XLA
`GpuTargetConfig` text proto: SM count, memory, bandwidth, compute capability, shipped in
`jaxdp/planner/targets/`) gives devices that `jax.jit(...).lower(...).compile()` compiles for through
XLA:GPU's whole pipeline (fusion, Triton GEMMs and Pallas kernels, the latency-hiding scheduler, buffer
assignment); nothing can run on them. The CPU must stay JAX's backend (JAX_PLATFORMS=cpu where no CUDA
driver is installed); the step takes the GPU's paths because they follow the platform of the mesh's
devices (`jaxdp.backends`, `kernels_pallas`, `jaxdp.parallel.places.ragged_a2a_on`).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

TARGETS_DIR = Path(__file__).parent / "targets"
PLUGIN_WHEELS = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
COMPILE_TARGETS = ("gpu", "cpu")


class TargetError(ValueError):
    """A compile target the planner cannot use; the message says what to write instead."""


def shipped_targets() -> list[str]:
    """GPU names with a target description: H100, H200, ..."""
    return sorted(p.stem.upper() for p in TARGETS_DIR.glob("*.pbtxt"))


def plugin_installed() -> bool:
    """Whether JAX can find the CUDA plugin (what XLA:GPU needs; no driver or GPU needed)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def default_target() -> str:
    return "gpu" if plugin_installed() else "cpu"


def target_description(gpu_name: str) -> str:
    """The GpuTargetConfig text proto shipped for this GPU."""
    path = TARGETS_DIR / f"{gpu_name.lower()}.pbtxt"
    if not path.is_file():
        raise TargetError(f"no XLA:GPU target description for GPU {gpu_name!r} (shipped: "
                          f"{', '.join(shipped_targets())}); use --gpu with one of them, or --compile-target cpu.")
    return path.read_text()


def target_fields(text: str) -> dict[str, float]:
    """The figures of a target description the report shows (memory, bandwidth, SMs, compute capability)."""
    def num(key: str) -> float:
        m = re.search(rf"\b{key}: ([\d.]+)", text)
        return float(m.group(1)) if m else 0.0

    cc = re.search(r"cuda_compute_capability \{\s*major: (\d+)(?:\s*minor: (\d+))?", text)
    return {"device_memory_size": num("device_memory_size"), "memory_bandwidth": num("memory_bandwidth"),
            "core_count": num("core_count"),
            "compute_capability": f"{cc.group(1)}.{cc.group(2) or 0}" if cc else "?"}


GPUS_PER_NODE = 8  # an HGX node: more GPUs than this are simulated as several nodes of this many


def node_topology(count: int, per_node: int = GPUS_PER_NODE) -> str:
    """The CUDA plugin's topology "slices x hosts x devices per host": one node up to `per_node` GPUs, else
    count / per_node nodes (processes) of `per_node` each, so the compiled program's collectives span hosts."""
    if count <= per_node:
        return f"1x1x{count}"
    if count % per_node:
        raise TargetError(f"{count} GPUs do not make whole nodes of {per_node}; use a multiple of {per_node} "
                          "with --gpus.")
    return f"1x{count // per_node}x{per_node}"


def gpu_devices(gpu_name: str, count: int) -> list:
    """`count` simulated GPUs of this kind, for a mesh to compile on: one host up to 8, else nodes of 8
    (`node_topology`; each node a process of its own, as a multi-node deployment runs)."""
    text = target_description(gpu_name)
    if not plugin_installed():
        raise TargetError("--compile-target gpu needs the CUDA plugin of JAX's version (pip install "
                          + " ".join(f'"{w}==<jax version>"' for w in PLUGIN_WHEELS)
                          + ", or jaxdp[xla-gpu]); use --compile-target cpu without it.")
    from jax.experimental.topologies import get_topology_desc

    try:
        topology = get_topology_desc(f"{gpu_name.lower()}x{count}", "cuda", target_config=text,
                                     topology=node_topology(count))
    except Exception as e:  # the plugin failed to start (e.g. JAX tried the CUDA driver)
        raise TargetError(f"the CUDA plugin could not describe {count} x {gpu_name} ({str(e).splitlines()[0]}); "
                          "run with JAX_PLATFORMS=cpu on a machine without a CUDA driver.") from None
    return list(topology.devices)


def compile_for_gpu(fn, *args, gpu_name: str = "H200"):
    """`jax.jit(fn)` compiled by XLA:GPU for one simulated GPU (args: ShapeDtypeStructs, placed on it): the
    kernels' tests compile, not only lower, their Triton kernels this way."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(gpu_devices(gpu_name, 1), ("x",)), PartitionSpec())
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    return jax.jit(fn).lower(*placed).compile()
