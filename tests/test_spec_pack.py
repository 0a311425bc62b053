"""A speculative step's inputs travel as one packed int32 array (`jaxdp.parallel.spec_step.pack`): every input comes
back on the device with its shape, dtype and values, for the decode (absorbed) and extend shapes, whose sequences
(B) and requests (R) differ."""

import numpy as np
import pytest

import jaxdp.engine.engine  # noqa: F401  (the engine first, as the package loads: spec_step imports it back)
from jaxdp.batch import SAMPLING_SPEC, SPEC_SPEC, STEP_SPEC, empty_spec, empty_step
from jaxdp.parallel.spec_step import pack, packed_layout, unpack
from jaxdp.parallel.step import StepShape


@pytest.mark.parametrize("shape", [StepShape(True, 8, 8, 3, draft_tokens=3),
                                   StepShape(False, 32, 4, 5, draft_tokens=3, shallow=True)])
def test_packed_inputs_come_back_as_they_were(shape):
    dp, rng = 2, np.random.default_rng(0)
    arrays = empty_step(dp, shape.num_rows, shape.num_seqs, shape.pages_per_seq, 99)
    arrays |= empty_spec(dp, shape.num_rows, shape.num_requests, shape.draft_tokens, 99)
    for a in (*STEP_SPEC, *SPEC_SPEC, *SAMPLING_SPEC):
        x = arrays[a.name]
        if x.dtype == np.bool_:
            arrays[a.name] = rng.random(x.shape) < 0.5
        elif x.dtype == np.float32:
            arrays[a.name] = rng.standard_normal(x.shape).astype(np.float32)
        else:
            arrays[a.name] = rng.integers(-5 if x.dtype == np.int32 else 0, 2**31 - 1, x.shape).astype(x.dtype)
    layout = packed_layout(shape)
    packed = pack(arrays, layout)
    assert packed.dtype == np.int32 and packed.shape[0] == dp
    back = unpack(packed, layout)
    assert set(back) == set(arrays)
    for name, x in arrays.items():
        y = np.asarray(back[name])
        assert y.dtype == x.dtype and y.shape == x.shape, name
        np.testing.assert_array_equal(y, x, err_msg=name)
