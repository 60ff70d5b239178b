"""torch's own FSDP test models against graphshard's FSDP1 frontend:
``torchrun --nproc-per-node N tests/workers/peer_fsdp.py CASE [CASE ...]``.

Each CASE is ``model:strategy:params[:flag ...]``. ``model`` is one of torch's
``torch.testing._internal.common_fsdp`` models, built by its own ``init`` with
``FSDPInitMode.RECURSIVE`` (so the wrapping is torch's helpers' own):

- ``nested``: ``NestedWrappedModule`` (``FSDP(layer)`` built inside the model, nested two deep),
  then wrapped at the root, as torch's ``_test_fsdp_parity`` does;
- ``delay``: ``NestedWrappedModuleWithDelay`` (the same, inside ``ModuleWithDelay``);
- ``moe``: ``MixtureOfExperts`` (the expert wrapped over a process group of one rank: each rank its
  own expert, never reduced), then wrapped at the root; its reference is torch's ``DummyDDP``;
- ``always``: ``AlwaysWrapNestedWrappedModule`` (``always_wrap_policy`` at the root);
- ``transformer``: ``TransformerWithSharedParams`` (``ModuleWrapPolicy`` on the encoder and decoder
  layers; input and output embeddings tied);
- ``enablewrap``: the ``NestedWrappedModule`` layout wrapped with ``enable_wrap``/``wrap``, the root
  too (``wrap(model)`` inside the context);
- ``rootless``: ``NestedWrappedModule`` as built, never wrapped at the root: each outer inner
  instance is a root of its own and the parent's own layers are plain (torch's FSDP1 the same).

``strategy``: a ``ShardingStrategy`` name in lower case (hybrid ones on a 2x2 ``device_mesh``);
``params``: flat | orig (``use_orig_params``). Flags: ``fp16`` / ``bf16`` (``MixedPrecision`` of
that dtype on every instance, reductions in fp32), ``innersgo`` (``enablewrap`` only: the inner
instances ``SHARD_GRAD_OP``, the root the case's strategy), ``innerbf16`` (``enablewrap`` only:
bf16 mixed precision everywhere, the root reducing in fp32 and the inner instances in bf16; a
root without mixed precision cannot hold bf16 inner units in this layout, in torch either: the
root's last layer would take their bf16 output), ``parity`` (torch's own
``FSDPTestMixin._test_fsdp_parity`` too, with graphshard's class as its ``FSDP``).

How graphshard's class gets into torch's helpers: they call the name ``FSDP`` of their module.
The worker loads a second copy of ``common_fsdp`` from its file and binds ``FSDP`` there to
graphshard's class; torch's module is untouched (the torch run uses it as it is). torch's
harness picks CUDA when there is one; on this CPU its ``DEVICE_TYPE`` is ``"cpu"`` and it runs as
written (``device_id=cpu`` is passed to both wrappers: torch's FSDP1 refuses a CPU-only build
without it).

The same training (torch's ``_train_for_several_steps`` loop: SGD with momentum, the models' own
``get_input`` / ``get_loss`` / ``run_backward``) runs three times: graphshard's frontend, torch's
FSDP1, and the unsharded model under torch's reference (``DDP``; ``DummyDDP`` for the experts).
Rank 0 reports the worst loss and full-state-dict differences, over all ranks, of each wrapper
against the reference and of the two against each other, the state-dict keys and shapes, and the
``named_parameters()`` names. graphshard lowers with Inductor, or as FX under ``GS_TEST_LOWER=eager``.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

from _compare import seq_err, tensor_err, worst
from _runner import lowering, run_cases

STEPS = 3
LR = 0.01
CPU = torch.device("cpu")


@functools.cache
def helpers(which: str):
    """torch's ``common_fsdp`` (``"torch"``) or a second copy of it whose ``FSDP`` is graphshard's."""
    import torch.testing._internal.common_fsdp as common_fsdp

    if which == "torch":
        return common_fsdp
    spec = importlib.util.spec_from_file_location("graphshard_peer_common_fsdp", common_fsdp.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    import graphshard.fsdp

    copy.FSDP = graphshard.fsdp.FullyShardedDataParallel
    return copy


def fsdp_kwargs(which: str, strategy: str, params: str, flags: list[str]) -> dict:
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    kw = dict(sharding_strategy=ShardingStrategy[strategy.upper()], use_orig_params=params == "orig",
              device_id=CPU, backward_prefetch=None)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("innerbf16", torch.bfloat16)):
        if name in flags:
            kw["mixed_precision"] = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
    if "hybrid" in strategy:
        from torch.distributed.device_mesh import init_device_mesh

        kw["device_mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                             mesh_dim_names=("replicate", "shard"))
    if which == "graphshard":
        kw["lower"] = lowering()
    return kw


def build(which: str, model: str, kw: dict, flags: list[str]):
    """The model as torch's helpers wrap it, with ``which``'s class as their ``FSDP``."""
    cf = helpers(which)
    FSDP = cf.FSDP
    group = dist.group.WORLD
    mode, dev = cf.FSDPInitMode.RECURSIVE, cf.DEVICEInitMode.DEVICE_NEVER
    if model in ("nested", "rootless"):
        m = cf.NestedWrappedModule.init(group, mode, dev, dict(kw), deterministic=True)
    elif model == "delay":
        m = cf.NestedWrappedModuleWithDelay.init(group, mode, dev, dict(kw), deterministic=True)
    elif model == "moe" and which == "torch":
        m = moe_from_pieces(cf, kw)
    elif model == "moe":
        m = cf.MixtureOfExperts.init(group, mode, dev, dict(kw), deterministic=True)
    elif model == "always":
        return cf.AlwaysWrapNestedWrappedModule.init(group, mode, dev, dict(kw), deterministic=True)
    elif model == "transformer":
        return cf.TransformerWithSharedParams.init(group, mode, dev, dict(kw), deterministic=True)
    elif model == "enablewrap":
        return enable_wrap_model(cf, kw, flags)
    else:
        raise ValueError(model)
    if model == "rootless":
        return m
    root_kw = {k: v for k, v in kw.items() if k != "device_mesh"}
    return FSDP(m, group, **root_kw)


def moe_from_pieces(cf, kw: dict):
    """torch's ``MixtureOfExperts`` as its ``RECURSIVE`` init wraps it, for torch's FSDP1 on a CPU:
    the init itself cannot run there (its ``NestedWrappedModule.__init__`` wraps layers that it then
    drops without passing ``device_id``, and torch's FSDP1 needs one on a CPU-only build: "FSDP needs a
    non-CPU accelerator device"). The same model unwrapped (the same seeds), then the shared layer
    over the world and the expert over a process group of this rank alone, as the init does."""
    group = dist.group.WORLD
    m = cf.MixtureOfExperts(group, wrap_fsdp=False, device_init_mode=cf.DEVICEInitMode.DEVICE_NEVER,
                            delay_before_free_ms=0, deterministic=True)
    expert_group = dist.new_group([group.rank()])
    m.module[2] = cf.FSDP(m.module[2], expert_group, **kw)
    m.module[1] = cf.FSDP(m.module[1], group, **kw)
    m.wrap_fsdp = True  # its run_backward then leaves the reduction to FSDP, as the init's model does
    return m


def enable_wrap_model(cf, kw: dict, flags: list[str]):
    """``NestedWrappedModule``'s layout wrapped by torch's ``enable_wrap``/``wrap`` (the FSDP1 idiom
    ``graphshard.fsdp.wrap`` re-exports), the root by ``wrap`` too; per-call overrides for the
    inner instances where a flag asks."""
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import enable_wrap, wrap

    m = cf.NestedWrappedModule.init(dist.group.WORLD, cf.FSDPInitMode.NO_FSDP, cf.DEVICEInitMode.DEVICE_NEVER,
                                    deterministic=True)
    inner = {}
    if "innersgo" in flags:
        inner["sharding_strategy"] = ShardingStrategy.SHARD_GRAD_OP
    if "innerbf16" in flags:  # the root bf16 reducing in fp32 (the case's kw), the inner instances reducing in bf16
        inner["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                  buffer_dtype=torch.bfloat16)
    with enable_wrap(wrapper_cls=cf.FSDP, **kw):
        m.module[1][0] = wrap(m.module[1][0], **inner)
        m.module[1] = wrap(m.module[1], **inner)
        m.module[2] = wrap(m.module[2], **inner)
        return wrap(m)


def reference(model: str):
    """The unsharded model under torch's harness reference: DDP (gradients averaged over the ranks),
    or ``DummyDDP`` for ``MixtureOfExperts``, whose own ``run_backward`` averages all but the experts."""
    cf = helpers("torch")
    group = dist.group.WORLD
    mode, dev = cf.FSDPInitMode.NO_FSDP, cf.DEVICEInitMode.DEVICE_NEVER
    if model == "moe":
        return cf.DummyDDP(cf.MixtureOfExperts.init(group, mode, dev, deterministic=True))
    cls = {"delay": cf.NestedWrappedModuleWithDelay, "always": cf.AlwaysWrapNestedWrappedModule,
           "transformer": cf.TransformerWithSharedParams}.get(model, cf.NestedWrappedModule)
    return nn.parallel.DistributedDataParallel(cls.init(group, mode, dev, deterministic=True))


def train(model) -> list[float]:
    """torch's ``_train_for_several_steps`` loop (without its scaler and autocast, which are off here)."""
    inner = model.module if hasattr(model, "module") and hasattr(model.module, "get_input") else model
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        x = inner.get_input(CPU)
        loss = inner.get_loss(x, model(*x))
        inner.run_backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def full_state_dict(which: str, model) -> dict:
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    FSDP = helpers(which).FSDP
    if FSDP.fsdp_modules(model):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _all_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sd_err(a: dict, b: dict) -> float:
    keys = [k for k in b if b[k].is_floating_point()]
    missing = [k for k in keys if k not in a]
    if missing:
        return float("inf")
    return worst(tensor_err(a[k].float(), b[k].float()) for k in keys)


def torch_parity(kw: dict, model: str) -> str:
    """torch's own ``_test_fsdp_parity`` with graphshard's class as its ``FSDP`` (the copy of its module):
    ``"ok"`` or its error. Its reference is DDP, its check torch's ``assertEqual`` on the parameters."""
    cf = helpers("graphshard")
    from torch.testing._internal.common_utils import TestCase

    class Harness(cf.FSDPTestMixin, TestCase):
        def runTest(self):
            pass

        @property
        def process_group(self):
            return dist.group.WORLD

    cls = {"nested": cf.NestedWrappedModule, "delay": cf.NestedWrappedModuleWithDelay, "moe": cf.MixtureOfExperts,
           "always": cf.AlwaysWrapNestedWrappedModule, "transformer": cf.TransformerWithSharedParams}[model]
    kwargs = {k: v for k, v in kw.items() if k not in ("sharding_strategy", "use_orig_params", "backward_prefetch",
                                                       "mixed_precision")}
    ref = {"ref_init_fn": cf.DummyDDP} if model == "moe" else {}
    try:
        Harness()._test_fsdp_parity(cls, cf.FSDPInitMode.RECURSIVE, cf.DEVICEInitMode.DEVICE_NEVER,
                                    sharding_strategy=kw["sharding_strategy"], use_orig_params=kw["use_orig_params"],
                                    **ref, **kwargs)
        return "ok"
    except Exception as e:  # reported, and the test asserts "ok"
        return f"{type(e).__name__}: {e}"[:600] + "\n" + traceback.format_exc()[-1500:]


def run_case(case: str) -> dict:
    model, strategy, params, *flags = case.split(":")
    torch._dynamo.reset()
    out = {"case": case, "lowering": lowering()}
    runs = {}
    for which in ("torch", "graphshard"):
        torch.manual_seed(0)
        wrapped = build(which, model, fsdp_kwargs(which, strategy, params, flags), flags)
        names = [n for n, _ in wrapped.named_parameters()]
        losses = train(wrapped)
        sd = full_state_dict(which, wrapped)
        runs[which] = (losses, sd)
        if which == "graphshard":
            wrapped_graphshard = wrapped
        out[f"{which}_names"] = names
        out[f"{which}_keys"] = {k: list(v.shape) for k, v in sd.items()}
        out[f"{which}_fsdp_modules"] = len(helpers(which).FSDP.fsdp_modules(wrapped))
    if {"fp16", "bf16", "innerbf16"} & set(flags):  # the whole effect of low precision: torch's FSDP1 without it
        plain = [f for f in flags if f not in ("fp16", "bf16", "innerbf16")]
        torch.manual_seed(0)
        fp32 = build("torch", model, fsdp_kwargs("torch", strategy, params, plain), plain)
        train(fp32)
        out["mp_effect"] = _all_max(_sd_err(full_state_dict("torch", fp32), runs["torch"][1]))
    torch.manual_seed(0)
    ref = reference(model)
    ref_losses = train(ref)
    ref_sd = {k: v.detach().clone() for k, v in ref.module.state_dict().items()}
    for which, (losses, sd) in runs.items():
        out[f"{which}_loss_err"] = _all_max(seq_err(losses, ref_losses))
        out[f"{which}_param_err"] = _all_max(_sd_err(sd, ref_sd))
        out[f"{which}_keys_match_reference"] = list(sd) == list(ref_sd)
    (gl, gsd), (tl, tsd) = runs["graphshard"], runs["torch"]
    out["between_loss_err"] = _all_max(seq_err(gl, tl))
    out["between_param_err"] = _all_max(_sd_err(gsd, tsd))
    if model == "rootless":  # an instance that ran as a root is not absorbed by a later root
        try:
            helpers("graphshard").FSDP(wrapped_graphshard)
            out["rewrap_error"] = None
        except ValueError as e:
            out["rewrap_error"] = str(e)
    if "parity" in flags:
        torch._dynamo.reset()
        out["torch_harness"] = torch_parity(fsdp_kwargs("graphshard", strategy, params, flags), model)
    return out


if __name__ == "__main__":
    run_cases(sys.argv[1:], run_case)
