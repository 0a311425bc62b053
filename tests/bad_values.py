"""Values a request's fields never accept, for the fuzz tests: drawn from the parser's own table
(`jaxdp.api.fields.SAMPLING` / `REQUEST`), so the generator and the rules cannot drift apart."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from jaxdp.api.fields import MAX_STOP, MAX_STOP_LEN, REQUEST, SAMPLING, Range

__all__ = ["BAD_VALUES", "CONTEXT", "REQUEST", "junk", "outside", "surrogate"]

junk = st.text(max_size=8) | st.booleans() | st.lists(st.integers(), max_size=3) | st.dictionaries(
    st.text(max_size=3), st.integers(), max_size=2)
surrogate = st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=3)
CONTEXT = 512  # the server's --max-total-tokens: a larger max_new_tokens is refused by check_length


def outside(rule: Range) -> st.SearchStrategy:
    """Values `rule` (the server's own table, jaxdp.api.fields) refuses: below and above its range, huge integers
    (which a number field takes as a float when one can hold it), the wrong JSON type."""
    lo, hi = int(math.floor(rule.lo)), int(math.ceil(rule.hi))
    finite = {"allow_nan": False, "allow_infinity": False}
    floats = (st.floats(**finite) if rule.kind is int  # a float is never an integer field's value
              else st.floats(max_value=rule.lo, **finite) | st.floats(min_value=rule.hi, **finite))
    huge = st.integers(min_value=2**64, max_value=10**300) | st.integers(min_value=-(10**300), max_value=-(2**64))
    numbers = st.integers(max_value=lo) | st.integers(min_value=hi, max_value=hi * 2**70) | floats | huge
    return (numbers | junk).filter(lambda v: not rule.accepts(v))


# per field: values that are never valid for it
BAD_VALUES = {name: outside(rule) for name, rule in SAMPLING.items()}
BAD_VALUES["max_new_tokens"] |= st.integers(min_value=CONTEXT, max_value=SAMPLING["max_new_tokens"].hi)
BAD_VALUES |= {
    "stop": st.lists(st.text(min_size=1, max_size=3), min_size=MAX_STOP + 1, max_size=MAX_STOP + 14) | st.just("")
    | st.lists(st.integers(), min_size=1, max_size=3) | st.text(min_size=MAX_STOP_LEN + 1, max_size=MAX_STOP_LEN + 44),
    "stop_token_ids": st.lists(st.integers(min_value=512, max_value=2**80) | st.integers(max_value=-1),
                               min_size=1, max_size=4) | st.text(min_size=1),
    "n": outside(REQUEST["n"]),
}
