"""Plan matching and the errors users get for bad plans."""

import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Shard

import graphshard
from _models import mesh1d, mlp, tiny_transformer
from graphshard.plan import fqn_match


def test_glob_star_stays_within_one_component():
    assert fqn_match("layers.0", "layers.*")
    assert not fqn_match("layers.0.attn", "layers.*")
    assert fqn_match("layers.0.attn", "layers.**")
    assert fqn_match("", "") and not fqn_match("fc1", "")


def test_unknown_key_names_key_and_closest_fqns():
    plan = graphshard.Plan(mesh1d("dp"), {"layer.*": graphshard.FullyShard(), "": graphshard.FullyShard()})
    with pytest.raises(ValueError, match=r"plan key 'layer\.\*' matches no module of Transformer; closest FQNs: \['layers"):
        graphshard.shard(tiny_transformer(), plan)


def test_key_naming_a_parameter_says_to_use_the_module():
    plan = graphshard.Plan(mesh1d("dp"), {"fc1.weight": graphshard.FullyShard(), "": graphshard.FullyShard()})
    with pytest.raises(ValueError, match=r"'fc1\.weight' names a parameter, not a module; keys name modules \(try 'fc1'\)"):
        graphshard.shard(mlp(), plan)


def test_unit_spec_needs_a_data_parallel_axis():
    with pytest.raises(ValueError, match=r"plan key '': FullyShard needs a data-parallel mesh axis.*add a 'dp' axis"):
        graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", weight=Shard(0)),
                                        "": graphshard.FullyShard()})


def test_shard_axis_must_be_a_data_parallel_axis():
    with pytest.raises(ValueError, match=r"FullyShard\(shard_axis='tp'\) is not a data-parallel axis"):
        graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard(shard_axis="tp")})


def test_non_spec_value_and_non_string_key():
    with pytest.raises(ValueError, match=r"plan key 'fc1' has spec 'colwise'; expected FullyShard\(\)"):
        graphshard.Plan(mesh1d("dp"), {"fc1": "colwise"})
    with pytest.raises(ValueError, match=r"plan key 3 is not a string"):
        graphshard.Plan(mesh1d("dp"), {3: graphshard.FullyShard()})


def test_parameters_without_a_unit_are_an_error_not_silently_replicated():
    plan = graphshard.Plan(mesh1d("dp"), {"fc1": graphshard.FullyShard()})
    with pytest.raises(ValueError, match=r"parameters \['fc2\.weight', 'fc2\.bias'\] belong to no unit.*\{'': FullyShard\(\)\}"):
        graphshard.shard(mlp(), plan)


def test_shard_params_names_a_missing_parameter():
    plan = graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", wieght=Shard(0))})
    with pytest.raises(ValueError, match=r"ShardParams on 'fc1' names parameter 'wieght', but that module has \['bias', 'weight'\]"):
        graphshard.shard(mlp(), plan)


def test_mesh_without_axis_names():
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="mesh with named axes"):
        graphshard.Plan(init_device_mesh("cpu", (4,)), {"": graphshard.FullyShard()})


def test_sharding_before_the_process_group_exists():
    code = (
        "import torch, graphshard\n"
        "from graphshard.testing.models import MLP\n"
        "from torch.distributed.device_mesh import DeviceMesh\n"
        "plan = object.__new__(graphshard.Plan)\n"
        "try:\n"
        "    graphshard.shard(MLP(), plan)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs a process group: call torch.distributed.init_process_group()" in out.stdout, out.stderr


def test_sharding_twice_is_an_error():
    model = mlp()
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()})
    graphshard.shard(model, plan)
    with pytest.raises(ValueError, match="already sharded by graphshard"):
        graphshard.shard(model, plan)


def test_strided_shard_needs_equal_blocks():
    # fc1.weight is (32, 16): 32 rows are not 3 equal blocks.
    plan = graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", weight=graphshard.StridedShard(0, 3))})
    with pytest.raises(ValueError, match=r"fc1\.weight: StridedShard\(dim=0, split_factor=3\) needs dim 0 \(size 32\) "
                                         r"to be 3 equal blocks"):
        graphshard.shard(mlp(), plan)


@pytest.mark.usefixtures("fake_collective_outputs")  # the shard is scattered from rank 0
def test_strided_shard_is_stored_as_dtensors_strided_shard():
    plan = graphshard.Plan(mesh1d("tp"), {"fc1": graphshard.ShardParams("tp", weight=graphshard.StridedShard(0, 2))})
    model = mlp()
    full = model.fc1.weight.detach().clone()
    graphshard.shard(model, plan)
    w = model.fc1.weight
    assert w.shape == (32, 16) and w.to_local().shape == (8, 16)
    assert type(w.placements[0]).__name__ == "_StridedShard" and w.placements[0].split_factor == 2
    # rank 0 of 4 holds the first quarter of each of the 2 blocks (rows 0:4 and 16:20), by hand
    assert torch.equal(w.to_local(), torch.cat([full[0:4], full[16:20]]))


def test_ignored_params_leave_parameters_alone_and_name_a_glob_that_matches_nothing():
    import torch.nn as nn
    from torch.distributed.tensor import DTensor

    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}, ignored_params=["1.**"])
    model = graphshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), plan)
    assert isinstance(model[0].weight, DTensor) and not isinstance(model[1].weight, DTensor)
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}, ignored_params=["2.**"])
    with pytest.raises(ValueError, match=r"ignored_params entry '2\.\*\*' matches no parameter"):
        graphshard.shard(nn.Sequential(nn.Linear(4, 4)), plan)
