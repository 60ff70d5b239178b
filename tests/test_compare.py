"""The parity workers' comparison helpers (``tests/workers/_compare.py``) treat NaN and inf as
failures wherever they appear: the way ``max`` dropped them once let an all-NaN run pass."""

from __future__ import annotations

import math

import pytest
import torch

from workers._compare import dict_err, dict_errs, scalar_err, seq_err, tensor_err, value_err, worst

NAN, INF = float("nan"), float("inf")
TOL = 1e-5


def test_python_max_drops_a_nan_the_helper_does_not():
    assert max(0.0, NAN) == 0.0  # the defect: a NaN after the first value disappears
    assert worst([0.0, NAN]) == math.inf
    assert worst([NAN, 0.0]) == math.inf
    assert worst([1e-7, -INF]) == math.inf
    assert worst([1e-7, 3e-7]) == 3e-7
    assert worst([]) == 0.0


@pytest.mark.parametrize("a,b", [(NAN, 1.0), (1.0, NAN), (NAN, NAN), (INF, INF), (-INF, 0.0)])
def test_non_finite_scalars_fail_either_way_a_check_is_written(a, b):
    err = scalar_err(a, b)
    assert err == math.inf
    assert err > TOL and not err <= TOL


def test_sequences():
    assert seq_err([1.0, 2.0], [1.0, 2.5]) == 0.5
    assert seq_err([1.0, NAN], [1.0, NAN]) == math.inf  # equal NaNs are still NaN losses
    with pytest.raises(ValueError, match="different lengths"):
        seq_err([1.0], [1.0, 2.0])


def test_tensors():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert tensor_err(a, a + 0.25) == 0.25
    assert tensor_err(a.bfloat16(), a.double()) == 0.0
    nan = a.clone()
    nan[1, 0] = NAN
    assert tensor_err(nan, a) == math.inf
    assert tensor_err(a, nan) == math.inf
    assert tensor_err(torch.full((3,), NAN), torch.full((3,), NAN)) == math.inf
    assert tensor_err(torch.empty(0), torch.empty(0)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        tensor_err(a, a[0])  # broadcasting would have compared row 0 with both rows


def test_state_dicts():
    want = {"w": torch.ones(2), "b": torch.zeros(1), "step": torch.tensor(3)}
    got = {"w": torch.ones(2), "b": torch.full((1,), NAN), "step": torch.tensor(3)}
    assert dict_errs(got, want) == {"w": 0.0, "b": math.inf, "step": 0.0}
    assert dict_err(got, want) == (math.inf, "b")
    assert dict_err(want, want) == (0.0, None)
    assert dict_err({"w": torch.ones(2)}, want) == (math.inf, "b")  # a missing key is a failure


def test_values_that_are_not_floats_must_be_equal():
    assert value_err(torch.tensor(3), torch.tensor(3)) == 0.0
    assert value_err(torch.tensor(2), torch.tensor(3)) == math.inf  # an optimizer step that differs
    assert value_err(torch.tensor([1, 2]), torch.tensor([1, 2, 3])) == math.inf
    assert value_err(torch.tensor(1.0), 1.0) == math.inf  # a tensor against a number is a different value
    assert value_err("adam", "adam") == 0.0 and value_err("adam", "sgd") == math.inf
    assert value_err(0.5, NAN) == math.inf
    assert dict_err({"step": torch.tensor(2)}, {"step": torch.tensor(3)}) == (math.inf, "step")
