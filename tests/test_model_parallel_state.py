"""graphshard.model_parallel's state: DCP checkpoints across plans and world sizes, and TorchRec interchange
(tests/workers/dmp_state.py, 2 gloo ranks, then 1 and 4 for loading); an ``EmbeddingCollection``'s too."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchrec")

from _launch import torchrun  # noqa: E402

pytestmark = pytest.mark.multirank  # every test reads a torchrun job's results or launches one


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dmp_state"))
    results = {r["case"]: r for r in torchrun("dmp_state.py", [d, "dcp", "interchange", "keyed", "combined"], nproc=2)}
    return d, results


def test_dcp_reloads_under_another_plan(saved):
    _, r = saved
    assert r["dcp"]["trained"] > 1e-3
    assert r["dcp"]["reader_start_diff"] > 1.0  # the reader began elsewhere: every value came from the load
    assert r["dcp"]["reshard_diff"] == 0.0 and r["dcp"]["next_loss_diff"] == 0.0, r["dcp"]


def test_fused_optimizer_state_resumes(saved):
    _, r = saved
    assert r["dcp"]["optim_entries"] == 4  # the four fused tables (the fifth is data-parallel)
    assert r["dcp"]["optim_resume_diff"] == 0.0, r["dcp"]


def test_torchrec_optimizer_classes_drive_the_fused_optimizer(saved):
    # fused_optimizer is a KeyedOptimizer laid out as TorchRec's (same keys and state names on every
    # rank); CombinedOptimizer, a torch LR scheduler and WarmupOptimizer set the kernels' lr; the
    # state dict reloads into the kernels' state
    r = saved[1]["keyed"]
    assert r["keyed"] and r["same_layout_as_torchrec_every_rank"], r
    assert r["lrs_after_schedule"] == pytest.approx([0.025]), r  # StepLR(gamma=0.5) on lr 0.05
    assert r["lrs_after_warmup_start"] == pytest.approx([0.1]), r  # WarmupOptimizer(lr=0.2), linear from 0.5
    assert r["state_changed_by_step"] > 0 and r["state_restored_err"] == 0.0, r


def test_combined_optimizer_state_reloads_under_another_plan(saved):
    # the fused tables' and the dense part's optimizer state, saved with DCP, reloads where the tables
    # sit elsewhere (a column-wise table's blocks on ranks [1, 0]); the next step is the writer's
    r = saved[1]["combined"]
    assert r["optim_keys"] >= 10 and r["reader_optim_start_diff"] > 1.0, r
    assert r["optim_reshard_diff"] == 0.0 and r["next_loss_diff"] == 0.0, r
    assert r["next_state_diff"] <= 1e-6 and r["next_optim_diff"] <= 1e-6, r


@pytest.mark.parametrize("world", [1, 4])
def test_combined_optimizer_state_on_another_world_size(saved, world):
    d, _ = saved
    (r,) = torchrun("dmp_state.py", [d, "combined_other_world"], nproc=world)
    if world == 1:  # one column block where the checkpoint has two: row-wise Adagrad's state differs
        assert r["refused"] and "t_cw" in r["refused"] and "momentum1" in r["refused"], r
    else:
        assert r["optim_reshard_diff"] == 0.0, r


@pytest.mark.parametrize("world", [1, 4])
def test_dcp_reloads_on_another_world_size(saved, world):
    d, _ = saved
    (r,) = torchrun("dmp_state.py", [d, "load_other_world"], nproc=world)
    assert r["world"] == world and r["reshard_diff"] == 0.0, r


def test_dcp_loads_into_the_unwrapped_model(saved):
    import torch.distributed.checkpoint as dcp

    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    import dmp as common

    d, _ = saved
    model = common.build("dlrm")
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=os.path.join(d, "dcp"), no_dist=True)
    full = torch.load(os.path.join(d, "full.pt"))
    assert sorted(state) == sorted(full)
    for k in full:
        assert torch.equal(state[k], full[k]), k


def test_torchrec_state_interchanges(saved):
    _, r = saved
    assert r["interchange"]["torchrec_to_graphshard"] == 0.0, r["interchange"]
    assert r["interchange"]["graphshard_to_torchrec"] == 0.0, r["interchange"]


def test_embedding_collection_state(tmp_path):
    # its own process, beside the DLRM checkpoint's
    (r,) = torchrun("dmp_state.py", [str(tmp_path), "sequence"], nproc=2)
    assert r["trained"] > 1e-3 and r["reader_start_diff"] > 1.0
    assert r["reshard_diff"] == 0.0 and r["next_loss_diff"] == 0.0, r  # DCP across plans
    assert r["graphshard_to_torchrec"] == 0.0 and r["torchrec_to_graphshard"] == 0.0, r
