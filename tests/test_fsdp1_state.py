"""FSDP1 checkpoints: graphshard <-> torch's FSDP1 <-> unwrapped (tests/workers/fsdp1_state.py).

On 2 gloo ranks the same user program (small transformer, ``ModuleWrapPolicy({Block})``,
AdamW, 2 steps) writes checkpoints with each wrapper and the single process; fresh models of
the others load them (FULL_STATE_DICT + ``optim_state_dict``, SHARDED_STATE_DICT through
``torch.distributed.checkpoint``, LOCAL_STATE_DICT, the legacy optimizer-state functions) and
their next step must give the writer's next loss and parameters (1e-5). The 2-rank sharded
checkpoints are then loaded on 1 and on 4 ranks; HYBRID_SHARD's FULL checkpoints (model and
optimizer state) interchange the same way on 4 ranks. The error paths run on the fake process group.
"""

from __future__ import annotations

import pytest
import torch

from _launch import torchrun
from _coverage_share import ci_share

TOL = 1e-5
TWO_RANK = [
    "full:full_shard:flat", "full:full_shard:orig", "full:shard_grad_op:orig", "full:no_shard:flat",
    "full:no_shard:orig",
    "sharded:flat:{dir}", "sharded:orig:{dir}", "local:flat:{dir}", "local:orig:{dir}", "legacy:flat", "legacy:orig",
    "ignored:orig",
]
FOUR_RANK = ["full:hybrid_shard:flat", "full:hybrid_shard:orig"]  # a (2, 2) mesh: replicate x shard
RESHARD = [1, 4]
RESHARD_CASES = [f"reshard@{n}" for n in RESHARD]
CASES = [c.replace(":{dir}", "") for c in TWO_RANK] + FOUR_RANK + RESHARD_CASES

_OFFLOAD = "torch optim_state_dict with offload_to_cpu=True vs unwrapped"
TORCH_WRONG = {
    ("full:full_shard:orig", _OFFLOAD), ("full:shard_grad_op:orig", _OFFLOAD), ("full:hybrid_shard:orig", _OFFLOAD),
    ("legacy:orig", "full_optim_state_dict(rank0_only=False) vs torch's"),
    ("legacy:orig", "full_optim_state_dict (rank 0) vs torch's"),
}
"""Checks where torch's FSDP1 (2.13, CPU device, gloo) is wrong and graphshard right. With
``use_orig_params=True`` and ``offload_to_cpu=True`` (FullOptimStateDictConfig's default, and
always in ``full_optim_state_dict``) its full optimizer state has ``exp_avg`` equal to
``exp_avg_sq``: each state's unflattened views alias one gather buffer that the next state
reuses, and ``.cpu()`` copies nothing on the CPU. Two more are asserted below: its FULL model
state dict with ``offload_to_cpu=True`` raises on a CPU device (and crashes the process with
``use_orig_params=True``), and under NO_SHARD ``rank0_only=True`` still gives the other ranks
the whole state dict, where its documentation promises an empty one (graphshard's are empty)."""


FULL_ONLY = {"full:full_shard:orig", "full:shard_grad_op:orig", "full:no_shard:orig", "local:orig", "legacy:flat",
             "full:hybrid_shard:flat", "reshard@1"}
"""Run under ``--coverage full`` only (`_coverage_share.ci_share`): the same checkpoint kind with the other
parameter form or strategy than a CI case, and the reload at one rank besides four. The
``sharded`` cases stay: the reshard loads what both left."""


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp1_ckpt"))
    out = {}
    two = ci_share(request.config, TWO_RANK, FULL_ONLY)
    for r in torchrun("fsdp1_state.py", [c.format(dir=root) for c in two], nproc=2):
        out[r["case"].replace(":" + root, "")] = r
    out.update({r["case"]: r for r in torchrun("fsdp1_state.py", ci_share(request.config, FOUR_RANK, FULL_ONLY),
                                               nproc=4)})
    for case in ci_share(request.config, RESHARD_CASES, FULL_ONLY):  # the sharded cases' checkpoints, other worlds
        out[case] = torchrun("fsdp1_state.py", [f"reshard:{root}"], nproc=int(case.split("@")[1]))[0]
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES)
def test_checkpoints_interchange(results, case):
    """Every difference under 1e-5 and every fact true, except where torch is known wrong."""
    r = results[case]
    bad = [f"{name}: {err:.3g} {r['info'].get(name, '')}" for name, err in r["err"].items()
           if (case, name) not in TORCH_WRONG and not err < TOL]
    bad += [f"{name}: {r['info'].get(name, '')}" for name, ok in r["ok"].items() if not ok]
    assert r["err"] and not bad, "\n".join(bad)


@pytest.mark.multirank
@pytest.mark.parametrize("case,check", sorted(TORCH_WRONG))
def test_torch_fsdp1_is_still_wrong(results, case, check):
    err = results[case]["err"][check]
    assert err > 1e-4, f"torch's FSDP1 now gets {check!r} right in {case} ({err}): drop it from TORCH_WRONG"


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["full:full_shard:flat", "full:no_shard:flat"])
def test_torch_full_state_dict_offload_to_cpu_on_a_cpu_device(results, case):
    """torch raises where it must gather; graphshard's offload gives plain CPU tensors (checked in the case)."""
    outcome = results[case]["info"]["torch offload_to_cpu on CPU"]
    if "no_shard" in case:
        assert outcome == "works", outcome
    else:
        assert outcome.startswith("raises"), f"torch's FSDP1 now offloads on CPU: {outcome}"


@pytest.mark.multirank
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("full:")])
def test_rank0_only_gives_other_ranks_an_empty_state_dict(results, case):
    seen = results[case]["info"]["rank0_only on the other ranks"]
    assert seen["gs"] == ["OrderedDict", 0, True], seen
    if "no_shard" in case:  # torch's defect: the whole model state dict on every rank
        assert seen["torch"][1] > 0, f"torch's FSDP1 now honours rank0_only under NO_SHARD: {seen}"
    else:
        assert seen["torch"] == seen["gs"], seen


# ---------------------------------------------------------------------------------------------
# Layout and errors on the fake process group (world size 4, rank 0): no collectives needed.
# ---------------------------------------------------------------------------------------------
def _wrapped(use_orig_params: bool = False):
    from graphshard.fsdp import FullyShardedDataParallel as FSDP
    from graphshard.fsdp.wrap import ModuleWrapPolicy
    from graphshard.testing.models import Block, Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=8))
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    return fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-2)


def _full_osd(fsdp, opt, step: float = 3.0) -> dict:
    """A full optimizer state dict keyed by FQN, each state tensor numbered so that places show."""
    names = [n for n, _ in _user_params(fsdp)]
    state = {}
    for i, (name, shape) in enumerate(_user_params(fsdp)):
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * i
        state[name] = {"step": torch.tensor(step), "exp_avg": full, "exp_avg_sq": full * 2}
    group = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": names}]}


def _user_params(fsdp):
    infos = fsdp._graphshard.params.values()
    return [(info.fqn, info.logical_shape) for info in infos]


def test_flat_state_is_each_parameters_local_chunk_in_its_slot():
    """optim_state_dict_to_load lays full state out as the flat parameter: this rank's chunk of
    each parameter at its slot's offset, the padding zero; ``step`` one value per unit."""
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    fsdp, opt = _wrapped()
    osd = _full_osd(fsdp, opt)
    opt.load_state_dict(FSDP.optim_state_dict_to_load(fsdp, opt, osd))
    state = fsdp._graphshard
    flat = [u.flat for u in state.units.values() if u.flat is not None]
    assert len(flat) == 3  # the root and its two layers
    assert sum(len(u.slots) for u in flat) == len(state.params)  # every parameter has a slot
    for unit in flat:
        st = opt.state[unit.param]
        assert st["step"].item() == 3.0 and st["exp_avg"].shape == unit.param.shape
        used = torch.zeros(unit.param.numel(), dtype=torch.bool)
        for slot in unit.slots:
            info = state.params[slot.key]
            # rank 0 of 4 holds torch.chunk's first piece of the full state (FSDP1's layout)
            want = torch.chunk(osd["state"][info.fqn]["exp_avg"], 4, dim=0)[0]
            assert torch.equal(st["exp_avg"].narrow(0, slot.offset, slot.numel).view(slot.shape), want), info.fqn
            used[slot.offset:slot.offset + slot.numel] = True
        assert not st["exp_avg"][~used].any()


def test_orig_params_state_is_a_dtensor_like_its_parameter():
    from torch.distributed.tensor import DTensor

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    fsdp, opt = _wrapped(use_orig_params=True)
    osd = _full_osd(fsdp, opt)
    opt.load_state_dict(FSDP.optim_state_dict_to_load(fsdp, opt, osd))
    seen = 0
    for name, p in fsdp.named_parameters():
        st = opt.state[p]
        assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].placements == p.placements
        assert st["exp_avg"].to_local().shape == p.to_local().shape
        full = osd["state"][name.replace("_fsdp_wrapped_module.", "")]
        for key in ("exp_avg", "exp_avg_sq"):  # rank 0 of 4: torch.chunk's first piece of the full state
            assert torch.equal(st[key].to_local(), torch.chunk(full[key], 4, dim=0)[0]), (name, key)
        assert float(st["step"]) == float(full["step"]) == 3.0, name
        seen += 1
    assert seen == len(list(fsdp.parameters())) > 0


def _set_step(osd):
    osd["state"]["layers.0.attn.wq.weight"]["step"] = torch.tensor(7.0)


def _wrong_shape(osd):
    osd["state"]["norm.weight"]["exp_avg"] = torch.zeros(3)


def _unknown_fqn(osd):
    osd["param_groups"][0]["params"].append("head.weight")


@pytest.mark.parametrize("corrupt,match", [
    (_set_step, "'step' differs between the parameters.*use_orig_params=True"),   # one flat parameter, two steps
    (_wrong_shape, "'exp_avg' of 'norm.weight' has shape \\(3,\\)"),            # names the FQN
    (_unknown_fqn, "'head.weight', which is no parameter of this optimizer"),     # in param_groups
])
def test_bad_optimizer_state_to_load_is_an_error(corrupt, match):
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    fsdp, opt = _wrapped()
    osd = _full_osd(fsdp, opt)
    corrupt(osd)
    with pytest.raises(ValueError, match=match):
        FSDP.optim_state_dict_to_load(fsdp, opt, osd)


def test_rekey_of_flat_parameters_is_an_error():
    """A flat parameter has several names (torch raises too); use_orig_params=True rekeys by FQN."""
    from graphshard.fsdp import FullyShardedDataParallel as FSDP, OptimStateKeyType

    fsdp, opt = _wrapped()
    osd = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": opt.state_dict()["param_groups"]}
    with pytest.raises(ValueError, match="flat parameter holding.*use_orig_params=True"):
        FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, fsdp, optim=opt)
    fsdp, opt = _wrapped(use_orig_params=True)
    osd = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": opt.state_dict()["param_groups"]}
    keyed = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, fsdp, optim=opt)
    assert list(keyed["state"]) == ["tok_embeddings.weight"]
    assert keyed["param_groups"][0]["params"] == sorted(n for n, _ in _user_params(fsdp))


def test_state_keyed_by_parameter_id_is_an_error_naming_rekey():
    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    fsdp, opt = _wrapped()
    osd = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": opt.state_dict()["param_groups"]}
    with pytest.raises(ValueError, match="keyed by parameter id.*rekey_optim_state_dict"):
        FSDP.optim_state_dict_to_load(fsdp, opt, osd)


def test_ignored_parameters_state_is_copied_as_it_is():
    """Parameters FSDP leaves alone (ignored_modules) keep their state unflattened, as torch's."""
    from graphshard.fsdp import FullyShardedDataParallel as FSDP
    from graphshard.fsdp.wrap import ModuleWrapPolicy
    from graphshard.testing.models import Block, Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=8))
    fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_modules=[model.norm])
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    osd = _full_osd(fsdp, opt)
    names = osd["param_groups"][0]["params"] + ["norm.weight", "norm.bias"]
    osd["param_groups"][0]["params"] = names
    for name in ("norm.weight", "norm.bias"):
        osd["state"][name] = {"step": torch.tensor(3.0), "exp_avg": torch.full((16,), 5.0),
                              "exp_avg_sq": torch.ones(16)}
    opt.load_state_dict(FSDP.optim_state_dict_to_load(fsdp, opt, osd))
    assert torch.equal(opt.state[model.norm.weight]["exp_avg"], torch.full((16,), 5.0))
    back = FSDP.optim_state_dict(fsdp, opt)["state"]["norm.weight"]  # (the fake group's gathers: values unread)
    assert torch.equal(back["exp_avg"], torch.full((16,), 5.0))
