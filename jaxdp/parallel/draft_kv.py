"""The MTP layer's draft KV beside the model's own in one paged pool: how its entries are named, and a pool split
into the two and joined back.

Both step functions read the pool (`jaxdp.parallel.step`, which owns it, and `jaxdp.parallel.spec_step`, which
the plain step calls for a speculative shape): this is what they share, so that neither imports the other back.
"""

from __future__ import annotations

DRAFT_PREFIX = "mtp_"  # the draft KV's entries in the pool (speculative decoding's MTP layer, one layer)


def split_draft(cache: dict) -> tuple[dict, dict]:
    """A pool's entries as (the model's own, the draft KV's under the names of the model's: prefix dropped)."""
    main = {k: v for k, v in cache.items() if not k.startswith(DRAFT_PREFIX)}
    draft_kv = {k[len(DRAFT_PREFIX):]: v for k, v in cache.items() if k.startswith(DRAFT_PREFIX)}
    return main, draft_kv


def join_draft(main: dict, draft_kv: dict) -> dict:
    """The pool again from `split_draft`'s two parts."""
    return {**main, **{DRAFT_PREFIX + k: v for k, v in draft_kv.items()}}
