"""torch's own FSDP test models and harness against graphshard.fsdp (tests/workers/peer_fsdp.py).

torch's ``torch.testing._internal.common_fsdp`` builds its models with their own FSDP1 wrapping
(``FSDPInitMode.RECURSIVE``): most by nested construction (``FSDP(layer)`` inside the model, then
the root), ``AlwaysWrapNestedWrappedModule`` and ``TransformerWithSharedParams`` by an
``auto_wrap_policy``. The worker runs each with graphshard's ``FullyShardedDataParallel`` bound as
the helpers' ``FSDP`` (a second copy of their module; torch's is untouched), with torch's own
FSDP1, and unsharded under torch's harness reference (DDP; ``DummyDDP`` for the experts), on 2
gloo ranks (hybrid strategies on 4, a 2x2 ``device_mesh``), through torch's training loop and the
models' own ``get_input`` / ``get_loss`` / ``run_backward``: losses and full state dicts within
1e-5 in fp32 (NaN fails), the same state-dict keys and shapes and ``named_parameters()`` as torch's.
``:parity`` cases also run torch's own ``FSDPTestMixin._test_fsdp_parity`` with graphshard's class.

Built from the helpers' pieces where torch's FSDP1 cannot run the helper on a CPU:
``MixtureOfExperts.init`` wraps layers without ``device_id`` (torch's FSDP1: "FSDP needs a non-CPU
accelerator device"), so torch's run builds the same model from its pieces (`moe_from_pieces`);
graphshard runs the helper's own init. ``NestedWrappedModule`` cannot take a hybrid strategy in
torch either (it passes one process group); the hybrid cases use ``TransformerWithSharedParams``
and the ``enable_wrap`` layout.

The API and refusals of nested construction run on the fake process group below.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _coverage_share import ci_share, launch_groups, lowering
from _launch import CaseResults, run_cases
from test_fsdp1 import BF16_SHARE

TOL = 1e-5
TWO_RANK = [
    "nested:full_shard:flat:parity",
    "nested:shard_grad_op:orig:parity",
    "nested:no_shard:flat",
    "nested:full_shard:orig",
    "delay:full_shard:flat:parity",
    "moe:full_shard:flat",
    "moe:shard_grad_op:orig",
    "moe:no_shard:flat",
    "always:full_shard:flat",
    "always:no_shard:orig",
    "transformer:full_shard:flat:parity",
    "transformer:shard_grad_op:orig",
    "enablewrap:full_shard:flat",
    "enablewrap:no_shard:orig:innersgo",
    "enablewrap:full_shard:flat:innerbf16",
    "rootless:full_shard:flat",
    "rootless:shard_grad_op:orig",
    "nested:full_shard:flat:bf16",
    "nested:shard_grad_op:orig:fp16",
]
FOUR_RANK = ["transformer:hybrid_shard:flat", "enablewrap:_hybrid_shard_zero2:orig"]
CI = {"nested:full_shard:flat:parity", "moe:shard_grad_op:orig", "enablewrap:no_shard:orig:innersgo",
      "rootless:full_shard:flat", "nested:full_shard:flat:bf16"}
FULL_ONLY = set(TWO_RANK + FOUR_RANK) - CI
"""Under ``--coverage full`` only (`_coverage_share.ci_share`): CI runs one case per wrapping path
(nested two deep with torch's harness, the one-rank expert group, ``enable_wrap`` with a per-instance
strategy, no root, bf16); the full run adds each strategy and parameter form per model, the policy
models, fp16 and the hybrid strategies."""
INDUCTOR_IN_CI: set[str] = set()
"""CI lowers every case as FX (one launch): the subject is the frontend's wrapping semantics, and the
FSDP1 suite (tests/test_fsdp1.py) puts the frontend's programs through Inductor; ``--coverage full``
lowers every case here with Inductor."""
ROOTLESS = [c for c in TWO_RANK if c.startswith("rootless:")]
"""No root instance: the parent's own layers are plain parameters, never reduced (torch's FSDP1 the
same), so both wrappers differ from the reference and must agree with each other."""
LOW_PRECISION = [c for c in TWO_RANK + FOUR_RANK if any(f in c.split(":") for f in ("fp16", "bf16", "innerbf16"))]
RANK_LOCAL = [c for c in TWO_RANK if c.startswith("moe:")]
"""The expert is wrapped over a process group of one rank: graphshard keeps its parameters as the
rank's own (unsharded, never reduced; `_nesting.nested_units`) under their own names, where torch's
flat-parameter form names one ``_flat_param`` (docs/frontends/fsdp.md)."""
FSDP_CASES = [c for c in TWO_RANK + FOUR_RANK if c not in ROOTLESS + LOW_PRECISION]

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results(request):
    out = CaseResults()
    for cases, nproc in ((ci_share(request.config, TWO_RANK, FULL_ONLY), 2),
                         (ci_share(request.config, FOUR_RANK, FULL_ONLY), 4)):
        for group, env in launch_groups(request.config, cases, INDUCTOR_IN_CI):
            out.update(run_cases("peer_fsdp.py", group, nproc=nproc, env=env))
    return out


def test_each_case_ran_the_lowering_its_launch_asked_for(results, request):
    for case, r in results.items():
        assert r.get("lowering") == lowering(request.config, case, INDUCTOR_IN_CI), (case, r.get("message"))


@pytest.mark.parametrize("case", FSDP_CASES)
def test_graphshard_matches_the_unsharded_model(results, case):
    r = results[case]
    assert r["graphshard_loss_err"] < TOL and r["graphshard_param_err"] < TOL, r
    assert r["graphshard_keys_match_reference"], r


@pytest.mark.parametrize("case", FSDP_CASES + ROOTLESS)
def test_graphshard_matches_torch_fsdp1(results, case):
    """The same wrapping by torch's FSDP1: torch matches the reference too (or, without a root, neither does)."""
    r = results[case]
    assert r["between_loss_err"] < TOL and r["between_param_err"] < TOL, r
    if case in ROOTLESS:
        assert r["torch_param_err"] > 1e-4 and r["graphshard_param_err"] > 1e-4, r  # the parent's layers: not reduced
    else:
        assert r["torch_loss_err"] < TOL and r["torch_param_err"] < TOL, r


@pytest.mark.parametrize("case", ROOTLESS)
def test_an_instance_that_ran_as_a_root_is_not_absorbed_later(results, case):
    assert "has already run a forward as a root" in (results[case]["rewrap_error"] or ""), results[case]


@pytest.mark.parametrize("case", LOW_PRECISION)
def test_mixed_precision_as_torch(results, case):
    """fp16 / bf16 ``MixedPrecision``: graphshard's run within a share of the whole effect of low precision
    on this program (torch's FSDP1 with and without it) of torch's, and as close to the unsharded fp32
    model as torch's within the same share."""
    r = results[case]
    assert r["mp_effect"] > 1e-6, r  # low precision changes this program measurably
    assert r["between_param_err"] < BF16_SHARE * r["mp_effect"], r
    assert r["graphshard_param_err"] < r["torch_param_err"] + BF16_SHARE * r["mp_effect"], r


@pytest.mark.parametrize("case", TWO_RANK + FOUR_RANK)
def test_state_dict_keys_shapes_and_units_are_torchs(results, case):
    r = results[case]
    assert r["graphshard_keys"] == r["torch_keys"], r  # the FULL state dict: the same keys and shapes
    assert r["graphshard_fsdp_modules"] == r["torch_fsdp_modules"], r


@pytest.mark.parametrize("case", TWO_RANK + FOUR_RANK)
def test_named_parameters_are_torchs(results, case):
    r = results[case]
    if case in RANK_LOCAL and ":flat" in case:
        ours = [n for n in r["graphshard_names"] if "module.2." not in n]
        theirs = [n for n in r["torch_names"] if "module.2." not in n]
        assert ours == theirs, r
        assert [n for n in r["graphshard_names"] if "module.2." in n] == [
            "_fsdp_wrapped_module.module.2._fsdp_wrapped_module.weight",
            "_fsdp_wrapped_module.module.2._fsdp_wrapped_module.bias"], r
        return
    assert r["graphshard_names"] == r["torch_names"], r


@pytest.mark.parametrize("case", [c for c in TWO_RANK if ":parity" in c])
def test_torchs_own_parity_harness_passes(results, case):
    """torch's ``_test_fsdp_parity`` (DDP reference, ``assertEqual`` on the summoned parameters,
    a state-dict save and load each step) with graphshard's class."""
    assert results[case]["torch_harness"] == "ok", results[case]["torch_harness"]


# ---------------------------------------------------------------------------------------------
# Nested construction on the fake process group (world size 4): structure and refusals.
# ---------------------------------------------------------------------------------------------
def _helpers():
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/workers")
    from peer_fsdp import helpers

    return helpers("graphshard")


def _nested(**kw):
    cf = _helpers()
    import torch.distributed as dist

    return cf, cf.NestedWrappedModule.init(dist.group.WORLD, cf.FSDPInitMode.RECURSIVE, cf.DEVICEInitMode.DEVICE_NEVER,
                                           kw, deterministic=True)


def test_nested_instances_become_the_units_in_place():
    from torch.distributed.fsdp import ShardingStrategy

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    cf, model = _nested(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    inner = [model.module[1], model.module[1].module[0], model.module[2]]
    assert all(isinstance(w, FSDP) for w in inner)
    assert inner[0]._is_root and inner[2]._is_root and inner[1]._root is inner[0]  # each complete as built
    root = FSDP(model)
    units = FSDP.fsdp_modules(root)
    assert [u._unit_fqn for u in units] == ["", "module.1", "module.1.0", "module.2"]
    assert units[1:] == [inner[0], inner[1], inner[2]] and all(u._root is root for u in units)  # the user's objects
    assert [u.sharding_strategy for u in units] == [ShardingStrategy.FULL_SHARD] + [ShardingStrategy.SHARD_GRAD_OP] * 3
    assert list(root.state_dict()) == [f"module.{i}.{p}" for i in ("0", "1.0", "1.1", "2", "3")
                                       for p in ("weight", "bias")]


def test_a_module_under_two_names_is_one_unit():
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    shared = FSDP(nn.Linear(8, 8), use_orig_params=True)
    model = nn.Sequential(nn.Linear(8, 8), shared, nn.ReLU(), shared)
    root = FSDP(model, use_orig_params=True)
    assert [u._unit_fqn for u in FSDP.fsdp_modules(root)] == ["", "1"]
    assert root.module[1] is root.module[3] is shared
    assert [n for n, _ in root.named_parameters()] == [
        "_fsdp_wrapped_module.0.weight", "_fsdp_wrapped_module.0.bias",
        "_fsdp_wrapped_module.1._fsdp_wrapped_module.weight", "_fsdp_wrapped_module.1._fsdp_wrapped_module.bias"]


def test_nested_instances_with_an_auto_wrap_policy_are_an_error():
    from torch.distributed.fsdp.wrap import always_wrap_policy

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    _, model = _nested()
    with pytest.raises(ValueError, match="auto-wrapping needs a model without FSDP applied"):
        FSDP(model, auto_wrap_policy=always_wrap_policy)


@pytest.mark.parametrize("inner, outer, error, match", [
    (dict(use_orig_params=True), dict(), ValueError, "use_orig_params=True, the root False"),
    (dict(limit_all_gathers=False), dict(), ValueError, "limit_all_gathers=False"),
    (dict(lower="eager"), dict(), ValueError, "compile options"),
])
def test_inner_settings_one_program_cannot_hold_are_refused(inner, outer, error, match):
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    _, model = _nested(**inner)
    with pytest.raises(error, match=match):
        FSDP(model, **outer)


def test_an_inner_instance_over_other_ranks_is_refused():
    import torch.distributed as dist

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    pair = dist.new_group([0, 1])
    model = nn.Sequential(FSDP(nn.Linear(8, 8), pair), nn.Linear(8, 8))
    with pytest.raises(NotImplementedError, match=r"shards over ranks \[0, 1\], the root over \[0, 1, 2, 3\]"):
        FSDP(model)


def test_a_one_rank_unit_with_mixed_precision_is_refused():
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecision

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    mine = dist.new_group([dist.get_rank()])
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    model = nn.Sequential(FSDP(nn.Linear(8, 8), mine, mixed_precision=mp), nn.Linear(8, 8))
    with pytest.raises(NotImplementedError, match="process group of one rank.*Drop mixed_precision"):
        FSDP(model, mixed_precision=mp)


def test_a_hybrid_inner_instance_under_a_flat_root_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(FSDP(nn.Linear(8, 8), device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD),
                          nn.Linear(8, 8))
    with pytest.raises(NotImplementedError, match="one compiled program shards over one mesh"):
        FSDP(model)


def test_wrapping_a_wrapper_is_an_error():
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    with pytest.raises(ValueError, match="wrap its module"):
        FSDP(FSDP(nn.Linear(8, 8)))


def test_an_inner_prefetch_setting_follows_the_root_and_explain_says_so(caplog):
    from torch.distributed.fsdp import BackwardPrefetch

    import graphshard
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    model = nn.Sequential(FSDP(nn.Linear(8, 8), backward_prefetch=BackwardPrefetch.BACKWARD_POST), nn.Linear(8, 8))
    with caplog.at_level("WARNING", logger="graphshard"):
        root = FSDP(model)
    assert "unit '0' was built with backward_prefetch=<BackwardPrefetch.BACKWARD_POST" in caplog.text
    assert "fallbacks (model): unit '0' was built with backward_prefetch" in graphshard.explain(root)


def test_three_levels_keep_each_instances_own_settings():
    """A one-rank unit absorbed by a middle instance stays one-rank when the root absorbs the middle;
    the units an inner ``auto_wrap_policy`` made keep its compile options."""
    import torch.distributed as dist
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import DTensor

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    mine = dist.new_group([dist.get_rank()])
    expert = FSDP(nn.Linear(8, 8), mine, use_orig_params=True, lower="eager")
    middle = FSDP(nn.Sequential(expert, nn.Linear(8, 8)), use_orig_params=True, lower="eager")
    blocks = FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                  use_orig_params=True, lower="eager")
    root = FSDP(nn.Sequential(middle, blocks, nn.Linear(8, 8)), use_orig_params=True, lower="eager")
    assert [u._unit_fqn for u in FSDP.fsdp_modules(root)] == ["", "0", "0.0", "1", "1.0", "1.1"]
    params = dict(root.named_parameters())
    assert not isinstance(params["_fsdp_wrapped_module.0._fsdp_wrapped_module.0._fsdp_wrapped_module.weight"], DTensor)
    assert isinstance(params["_fsdp_wrapped_module.0._fsdp_wrapped_module.1.weight"], DTensor)
