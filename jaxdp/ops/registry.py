"""Which backend runs each hot operation: the one table, and the one function that chooses.

Every operation the model's step spends its time in (`OPS`) lists its backends, the platforms each runs on, the
default per platform and the flag that chooses (SGLang's spelling). The backends (`BACKENDS`):

- xla: plain jnp / lax, the reference every other backend is checked against (`tests/test_ops.py`);
- pallas: the Pallas kernels of `kernels_pallas`, compiled by Triton on a GPU and run in interpret mode on a CPU
  (for checking; slow);
- native: jaxdp's C++ kernels for XLA:CPU (`jaxdp.native`), only where they are built (a C++ compiler, and
  `JAXDP_NATIVE` not 0);
- auto, blocked (the MoE runner's): XLA forms that pick per step shape (`jaxdp.ops.experts`).

Where a backend cannot take an operand (a shape its kernel does not tile, a dtype it does not read) the operation
falls back to its xla form, as it always did; choosing a backend never changes a result beyond float rounding.

`choose(op, requested, platform, device_kind)` is the only place a default is decided: the requested backend
(refused in one sentence naming the flag and the choices when unknown or unable to run here), else a measured
winner for this GPU kind (`winners.json` beside this module, keyed by `device.device_kind` and written by a GPU
sweep; empty until one runs), else the table's default for the platform (xla when that one is not available).

`--enable-deterministic-inference` (`deterministic_backend`): each operation runs its batch-invariant backend
(`INVARIANT`: one whose result for a row does not depend on the other rows of the step, their number or the
context's page-table width), or the flag is refused in one sentence where none runs here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax

from jaxdp import native

PLATFORMS = ("cpu", "gpu", "tpu")
WINNERS = Path(__file__).with_name("winners.json")

BACKENDS = {  # backend -> the platforms it runs on
    "xla": ("cpu", "gpu", "tpu"),
    "pallas": ("cpu", "gpu"),  # Pallas' Triton backend: compiled on a GPU, interpreted on a CPU; not a TPU's
    "native": ("cpu",),  # XLA:CPU custom calls
    "auto": ("cpu", "gpu", "tpu"),
    "blocked": ("cpu", "gpu", "tpu"),
}


@dataclasses.dataclass(frozen=True)
class Op:
    """One hot operation: the flag that chooses its backend (None: none, the default always), its backends, the
    default per platform, and where its code lies."""

    flag: str | None
    backends: tuple[str, ...]
    default: dict[str, str]
    where: str


OPS = {
    "projection_gemm": Op("--fp8-gemm-backend", ("xla", "pallas", "native"),
                          {"cpu": "native", "gpu": "pallas", "tpu": "xla"}, "jaxdp.ops.gemm.projection"),
    "expert_gemm": Op("--moe-runner-backend", ("auto", "xla", "blocked", "pallas", "native"),
                      {"cpu": "auto", "gpu": "pallas", "tpu": "auto"}, "jaxdp.ops.experts"),
    "mla_decode": Op("--attention-backend", ("xla", "pallas", "native"),
                     {"cpu": "native", "gpu": "pallas", "tpu": "xla"}, "jaxdp.ops.attention.decode_kernels"),
    "sparse_mla_decode": Op("--attention-backend", ("xla", "pallas"),
                            {"cpu": "xla", "gpu": "pallas", "tpu": "xla"}, "jaxdp.ops.attention.decode_kernels"),
    "prompt_attention": Op("--attention-backend", ("xla",),
                           {"cpu": "xla", "gpu": "xla", "tpu": "xla"}, "jaxdp.model.mla_prompt"),
    "lm_head": Op(None, ("xla", "native"), {"cpu": "native", "gpu": "xla", "tpu": "xla"},
                  "jaxdp.ops.gemm.lm_head_product"),
    "sampling": Op(None, ("xla",), {"cpu": "xla", "gpu": "xla", "tpu": "xla"}, "jaxdp.engine.step.sampling"),
}


# op -> platform -> its batch-invariant backend (docs/determinism.md): jaxdp's native CPU kernels compute each row
# (each row's attention) on its own in a fixed order; XLA:CPU's dots pick their blocking from the shapes, and the
# GPU kernels have not been made invariant yet
INVARIANT = {
    "projection_gemm": {"cpu": "native"},
    "expert_gemm": {"cpu": "native"},
    "mla_decode": {"cpu": "native"},
    "lm_head": {"cpu": "native"},
}
DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def deterministic_backend(op: str, requested: str | None = None, platform: str | None = None) -> str:
    """The backend `op` runs under --enable-deterministic-inference on `platform`: its batch-invariant one
    (`INVARIANT`); a ValueError in one sentence where it cannot run here or another one was requested."""
    where = platform_of(platform)
    backend = INVARIANT[op].get(where)
    if backend is None:
        return _refuse(f"needs jaxdp's native CPU kernels; on a {where.upper()} no batch-invariant kernels are built "
                       "yet: leave the flag out")
    if requested not in (None, backend):
        return _refuse(f"runs {OPS[op].flag} {backend} (batch-invariant); leave out {OPS[op].flag} {requested}")
    if not runs_here(backend, where):
        return _refuse("needs jaxdp's native CPU kernels, which are not built on this machine (no C++ compiler, "
                       "or JAXDP_NATIVE=0): install a C++ compiler or leave the flag out")
    return backend


def deterministic_conflict(attention: str | None, moe_runner: str | None, fp8_gemm: str | None) -> str | None:
    """The one sentence that refuses a backend flag beside --enable-deterministic-inference on any platform (one
    not batch-invariant on a CPU), or None; checked before anything loads (the platform is checked later)."""
    for op, requested in (("mla_decode", attention), ("expert_gemm", moe_runner), ("projection_gemm", fp8_gemm)):
        if requested not in (None, INVARIANT[op]["cpu"]):
            return (f"{DETERMINISTIC_FLAG} runs {OPS[op].flag} {INVARIANT[op]['cpu']} (batch-invariant); leave out "
                    f"{OPS[op].flag} {requested}")
    return None


def deterministic_model_refusal(cfg, quantization: str | None = None, nvfp4_checkpoint: bool = False) -> str | None:
    """The one sentence that refuses a model under --enable-deterministic-inference, or None: one whose products
    the native kernels do not take, so that they fall back to XLA's forms, which pick their blocking by the
    step's shape (docs/determinism.md, "Models the native kernels do not take"). `cfg` a ModelConfig (read
    without the weights), `quantization` the --quantization flag, `nvfp4_checkpoint` a ModelOpt NVFP4 one."""
    if quantization or cfg.fp8_block or nvfp4_checkpoint:
        what = (f"--quantization {quantization}" if quantization else
                "this checkpoint's NVFP4 experts" if nvfp4_checkpoint else "this checkpoint's block-FP8 weights")
        return (f"{DETERMINISTIC_FLAG} has no batch-invariant products for {what} (they run in XLA's forms): serve "
                "a bfloat16 or float32 checkpoint without --quantization, or leave the flag out")
    if cfg.index_topk:
        return (f"{DETERMINISTIC_FLAG} has no batch-invariant form of DSA's sparse attention (this model's "
                "indexer layers attend in XLA's form): serve a dense-MLA model or leave the flag out")
    widths = {"qk_nope_head_dim": (cfg.qk_nope_head_dim, 16), "qk_rope_head_dim": (cfg.qk_rope_head_dim, 16),
              "v_head_dim": (cfg.v_head_dim, 16), "kv_lora_rank": (cfg.kv_lora_rank, 64),
              "hidden_size": (cfg.hidden_size, 16), "q_lora_rank": (cfg.q_lora_rank or 16, 16)}
    off = [f"{name} {w} (not a multiple of {m})" for name, (w, m) in widths.items() if w % m]
    if off:
        return (f"{DETERMINISTIC_FLAG} needs widths the native kernels take, and this model has "
                f"{', '.join(off)}, which fall back to XLA's shape-dependent forms: serve a model of such widths "
                "or leave the flag out")
    return None


def _refuse(why: str) -> str:
    raise ValueError(f"{DETERMINISTIC_FLAG} {why}")


def platform_of(platform: str | None = None) -> str:
    """"cpu", "gpu" or "tpu": `platform` (a JAX platform name: a mesh of simulated GPUs, `jaxdp.planner`) or JAX's
    default backend's."""
    name = platform or jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def on_gpu(platform: str | None = None) -> bool:
    return platform_of(platform) == "gpu"


def flag_choices(flag: str) -> tuple[str, ...]:
    """The backends a flag may name: those of the operations it chooses for, in the table's order."""
    seen: dict[str, None] = {}
    for op in OPS.values():
        if op.flag == flag:
            seen.update(dict.fromkeys(op.backends))
    return tuple(seen)


def runs_here(backend: str, platform: str) -> bool:
    """Whether `backend` can run on `platform` on this machine (native: only where its kernels are built)."""
    return platform in BACKENDS[backend] and (backend != "native" or native.available())


def refusal(flag: str, backend: str, platform: str) -> str | None:
    """The one sentence that refuses `flag backend` on `platform`, or None when it can run."""
    choices = flag_choices(flag)
    if backend not in choices:
        return f"{flag} {backend!r} is not one of {', '.join(choices)}"
    if platform not in BACKENDS[backend]:
        here = ", ".join(b for b in choices if platform in BACKENDS[b])
        return f"{flag} {backend} does not run on a {platform.upper()}: choose one of {here}"
    if not runs_here(backend, platform):
        here = ", ".join(b for b in choices if b != "native" and platform in BACKENDS[b])
        return (f"{flag} native needs jaxdp's native CPU kernels, which are not built on this machine (no C++ "
                f"compiler, or JAXDP_NATIVE=0): choose one of {here}")
    return None


@functools.cache
def _winners_file() -> dict[str, dict[str, str]]:
    return json.loads(WINNERS.read_text()) if WINNERS.exists() else {}


def winners(device_kind: str | None) -> dict[str, str]:
    """The backends a GPU sweep measured fastest on this device kind ({op: backend}; empty when none ran)."""
    return dict(_winners_file().get(device_kind or "", {}))


def choose(op: str, requested: str | None = None, platform: str | None = None,
           device_kind: str | None = None) -> str:
    """The backend `op` runs on `platform` (None: JAX's default backend's): `requested` when given (a ValueError in
    one sentence when it is unknown or cannot run here), else this device kind's measured winner, else the
    table's default for the platform, else xla."""
    spec, where = OPS[op], platform_of(platform)
    if requested is not None:
        if spec.flag is None:
            raise ValueError(f"{op} has no flag: it runs {spec.default[where]} on a {where.upper()}")
        if (why := refusal(spec.flag, requested, where)) is not None:
            raise ValueError(why)
        return requested if requested in spec.backends else "xla"  # (the flag's choice, for an op without it)
    for backend in (winners(device_kind).get(op), spec.default.get(where, "xla")):
        if backend in spec.backends and runs_here(backend, where):
            return backend
    return "xla"


ATTENTION_BACKENDS = flag_choices("--attention-backend")
MOE_RUNNER_BACKENDS = flag_choices("--moe-runner-backend")
FP8_GEMM_BACKENDS = flag_choices("--fp8-gemm-backend")


def moe_runner_backend(backend: str | None, platform: str | None = None, deterministic: bool = False) -> str:
    """The MoE runner backend the step gives the model (None: the platform's default; `deterministic`: the
    batch-invariant one, `deterministic_backend`)."""
    if deterministic:
        return deterministic_backend("expert_gemm", backend, platform)
    return choose("expert_gemm", backend, platform)


def fp8_gemm_backend(backend: str | None, platform: str | None = None, device_kind: str | None = None,
                     deterministic: bool = False) -> str | None:
    """The projection GEMM's backend the model is built with: the requested one (refused in one sentence when it
    cannot run here), else this GPU kind's measured winner, else None: the platform's default (`OPS`), picked
    where the step is lowered, so that one traced step serves a CPU and a GPU target alike; `deterministic`: the
    batch-invariant one (`deterministic_backend`)."""
    if deterministic:
        return deterministic_backend("projection_gemm", backend, platform)
    if backend is None and winners(device_kind).get("projection_gemm") is None:
        return None
    return choose("projection_gemm", backend, platform, device_kind)


def check_flags(attention: str | None, moe_runner: str | None, fp8_gemm: str | None,
                platform: str | None = None) -> None:
    """Refuse, in one sentence (a ValueError), any of the three backend flags that names a backend unknown to it
    or unable to run on `platform` (None: JAX's default backend's), before anything is built."""
    for op, requested in (("mla_decode", attention), ("expert_gemm", moe_runner), ("projection_gemm", fp8_gemm)):
        if requested is not None:
            choose(op, requested, platform)
