"""Where jaxdp keeps what it makes once per machine (the peer checkpoint, the machine's roofline, the native
kernels it builds)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """jaxdp's cache directory (JAXDP_CACHE, else $XDG_CACHE_HOME/jaxdp, else ~/.cache/jaxdp)."""
    if os.environ.get("JAXDP_CACHE"):
        return Path(os.environ["JAXDP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxdp"
