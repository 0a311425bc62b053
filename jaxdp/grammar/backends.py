"""The grammar backends by SGLang's `--grammar-backend` names."""

from __future__ import annotations

from jaxdp.grammar import llguidance_backend, xgrammar_backend

BACKENDS = {"llguidance": llguidance_backend.LLGuidanceBackend, "xgrammar": xgrammar_backend.XGrammarBackend}
# the default: measured against xgrammar by `python -m jaxdp.bench.grammar` (docs/api.md, "Structured outputs")
DEFAULT_BACKEND = "llguidance"
_LIBRARIES = {"llguidance": llguidance_backend.llguidance, "xgrammar": xgrammar_backend.xgrammar}


def installed_backends() -> list[str]:
    """The backends whose library this Python has."""
    return [name for name, library in _LIBRARIES.items() if library is not None]


def backend_problem(name: str) -> str | None:
    """Why `--grammar-backend name` cannot run here, in one sentence, or None."""
    if name == "none":
        return None
    if name not in BACKENDS:
        return f"--grammar-backend {name!r} is not one jaxdp knows: use one of {', '.join(BACKENDS)} or none"
    if _LIBRARIES[name] is None:
        return f"--grammar-backend {name} needs the {name} library: pip install {name}, or choose another backend"
    return None
