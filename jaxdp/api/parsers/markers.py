"""Finding format markers in text that arrives in pieces.

A streamed parser may act on a marker only when no later text can change what it sees: a marker split across two
deltas must not leak into the output half-way, and a marker found whole must not be one that a longer, earlier
match would have hidden. These two helpers say what is decided so far; every parser in this package acts only on
what they return, which is what makes a streamed parse equal the one-shot parse at any split."""

from collections.abc import Sequence


def partial_suffix_len(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of `text` that is the start of a marker but not a whole one (0 if none):
    the text a streamed parser has to hold back until the next delta says what it is."""
    longest = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[len(text) - size :]):
                longest = size
                break
    return longest


def find_first(text: str, markers: Sequence[str], final: bool) -> tuple[int, str] | None:
    """The earliest whole marker in `text` as (index, marker), or None while there is none or while a marker that
    has only begun at the end of the text could still complete at an earlier index (never once `final`: no text
    will follow)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        index = text.find(marker)
        if index >= 0 and (best is None or index < best[0] or (index == best[0] and len(marker) > len(best[1]))):
            best = (index, marker)
    if best is None or final:
        return best
    if len(text) - partial_suffix_len(text, markers) < best[0]:
        return None
    return best
