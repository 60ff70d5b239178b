"""Issue 74 on 2 gloo ranks (tests/workers/misuse.py): the full state dict through torch's
``get_model_state_dict`` / ``set_model_state_dict`` and plain ``load_state_dict``, a meta-device
model materialized with ``to_empty``, and ``param_dtype=bf16`` units fed fp32 inputs against FSDP2
and the single process."""

from __future__ import annotations

import pytest

from _coverage_share import launch_groups
from _launch import torchrun

CASES = ("state_dict", "meta", "mixed_precision")
INDUCTOR_IN_CI = {"mixed_precision"}  # the bf16 cast runs in the compiled code


@pytest.fixture(scope="module")
def results(request):
    out = {}
    for cases, env in launch_groups(request.config, CASES, INDUCTOR_IN_CI):
        out.update({r["case"]: r for r in torchrun("misuse.py", cases, nproc=2, timeout=600, env=env)})
    return out


def test_full_state_dict_through_torch_dcp_helpers_is_the_single_process_one(results):
    r = results["state_dict"]
    assert r["loss_err"] <= 1e-5
    assert r["state_dict_types"] == ["DTensor"]  # model.state_dict() itself: this rank's shards, as DTensors
    assert r["full_keys"] and r["full_plain"] and r["full_err"] <= 1e-5, r  # rank 0: whole CPU tensors
    assert r["set_model_state_dict_err"] <= 1e-5 and r["load_state_dict_err"] == 0.0
    assert r["load_state_dict_missing"] == []


def test_meta_model_materialized_with_to_empty_trains_as_the_single_process(results):
    r = results["meta"]
    assert r["was_meta"] and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r


def test_bf16_units_cast_fp32_inputs_as_fsdp2_does(results):
    r = results["mixed_precision"]
    assert r["out_dtypes"] == ["torch.bfloat16", "torch.bfloat16"], r
    # the same bf16 programs: FSDP2's losses exactly here; parameters within bf16's resolution of each
    # other and of the fp32 single process (FSDP2 is as far from it)
    assert r["loss_err_peer"] <= 1e-3 and r["param_err_peer"] <= 5e-3, r
    assert r["loss_err_single"] <= 1e-2 and r["param_err_single"] <= 5e-3, r
    assert r["peer_loss_err_single"] <= 1e-2 and r["peer_param_err_single"] <= 5e-3, r
