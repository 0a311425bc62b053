"""A step's inputs travel as one packed int32 array (`jaxdp.parallel.packing`): every input comes back on the
device with its shape, dtype and values: a speculative step's, for the decode (absorbed) and extend shapes, whose
sequences (B) and requests (R) differ, and a plain step's (`StepRunner.run`)."""

import numpy as np
import pytest

import jaxdp.engine.loop  # noqa: F401  (the engine first, as the package loads: spec_step imports it back)
from jaxdp.batch import SAMPLING_SPEC, SPEC_SPEC, STEP_SPEC, empty_spec, empty_step
from jaxdp.parallel.packing import pack, unpack
from jaxdp.parallel.spec_step import packed_layout
from jaxdp.parallel.step import StepShape, packed_step_layout


def random_like(arrays, rng):
    for name, x in arrays.items():
        if x.dtype == np.bool_:
            arrays[name] = rng.random(x.shape) < 0.5
        elif x.dtype == np.float32:
            arrays[name] = rng.standard_normal(x.shape).astype(np.float32)
        else:
            arrays[name] = rng.integers(-5 if x.dtype == np.int32 else 0, 2**31 - 1, x.shape).astype(x.dtype)
    return arrays


def same_back(arrays, layout):
    packed = pack(arrays, layout)
    assert packed.dtype == np.int32 and packed.shape[0] == len(next(iter(arrays.values())))
    back = unpack(packed, layout)
    assert set(back) == set(arrays)
    for name, x in arrays.items():
        y = np.asarray(back[name])
        assert y.dtype == x.dtype and y.shape == x.shape, name
        np.testing.assert_array_equal(y, x, err_msg=name)


@pytest.mark.parametrize("shape", [StepShape(True, 8, 8, 3), StepShape(False, 32, 4, 5),
                                   StepShape(False, 6, 2, 5, all_logits=True)])
def test_a_plain_steps_inputs_come_back_as_they_were(shape):
    arrays = empty_step(3, shape.num_rows, shape.num_seqs, shape.pages_per_seq, 99)
    layout = packed_step_layout(shape)
    arrays = random_like({name: arrays[name] for name, *_ in layout}, np.random.default_rng(1))
    if shape.all_logits:  # every row's logits: T of them
        arrays["logits_idx_B"] = np.zeros((3, shape.num_rows), np.int32)
    same_back(arrays, layout)


@pytest.mark.parametrize("shape", [StepShape(True, 8, 8, 3, draft_tokens=3),
                                   StepShape(False, 32, 4, 5, draft_tokens=3)])
def test_packed_inputs_come_back_as_they_were(shape):
    dp = 2
    arrays = empty_step(dp, shape.num_rows, shape.num_seqs, shape.pages_per_seq, 99)
    arrays |= empty_spec(dp, shape.num_rows, shape.num_requests, shape.draft_tokens, 99)
    arrays = {a.name: arrays[a.name] for a in (*STEP_SPEC, *SPEC_SPEC, *SAMPLING_SPEC)}
    same_back(random_like(arrays, np.random.default_rng(0)), packed_layout(shape))
