"""Section ``frontends``: the dense frontends as a user of torch's APIs runs them on one GPU, each against the
same program in one process (plain torch, same device, same initial weights):

- ``graphshard.fsdp.FullyShardedDataParallel`` on a ``"cpu:gloo,cuda:nccl"`` process group (gloo
  in the dry run) with ``device_id``, ``sync_module_states`` and ``ModuleWrapPolicy``, over a model
  built on the CPU whose BatchNorm buffers must move to the GPU with it;
- the same over a model built on the ``meta`` device (materialized on the GPU by
  ``reset_parameters``; the reference takes the values it got);
- ``graphshard.tensor_parallel.parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``)
  on a one-rank ``"tp"`` mesh.

Each trains 3 SGD steps, compiled by Inductor (Triton on the GPU); loss and every parameter (a
FULL state dict for FSDP) must match within 1e-5, and the buffers must match too.
"""

from __future__ import annotations

STEPS, TOL = 3, 1e-5


def _model():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.norm, self.down = nn.Linear(12, 20), nn.BatchNorm1d(20), nn.Linear(20, 12)

        def forward(self, x):
            return x + self.down(self.norm(self.up(x)).relu())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(12, 1)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x).squeeze(-1)

    return Net, Block


def _train(model, dev, steps=STEPS) -> list[float]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 12, generator=g).to(dev), torch.randn(16, generator=g).to(dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _compare(res, name: str, losses, ref_losses, state: dict, ref_state: dict, dev) -> None:
    from check_common import max_abs_diff, worst

    missing = sorted(set(ref_state) ^ set(state))
    res.check(f"{name}: the state dict has the model's keys", not missing, f"differ: {missing[:6]}")
    on_device = all(t.device.type == dev.type for t in state.values())
    res.check(f"{name}: every parameter and buffer is on {dev.type}", on_device)
    loss_err = worst(abs(a - b) for a, b in zip(losses, ref_losses))
    state_err = worst(max_abs_diff(state[k].cpu(), ref_state[k].cpu()) for k in ref_state if k in state)
    res.fig(**{f"{name}_loss_err": loss_err, f"{name}_state_err": state_err})
    res.check(f"{name}: matches the single process", loss_err <= TOL and state_err <= TOL,
              f"max |loss diff| {loss_err:.2e}, max |param or buffer diff| {state_err:.2e}")


def _full_state(model) -> dict:
    from graphshard.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fsdp(res, dry: bool, dev, meta: bool) -> None:
    import copy

    import torch
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from graphshard.fsdp import FullyShardedDataParallel as FSDP

    Net, Block = _model()
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()  # on the CPU: FSDP moves it to device_id
        ref = copy.deepcopy(model).to(dev)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=None if dry else dev,
                   sync_module_states=True)
    if meta:  # the reference starts from what materialization gave
        ref = Net().to(dev)
        ref.load_state_dict(_full_state(wrapped))
    name = "fsdp_meta" if meta else "fsdp_cpu_built"
    losses, ref_losses = _train(wrapped, dev), _train(ref, dev)
    _compare(res, name, losses, ref_losses, _full_state(wrapped), ref.state_dict(), dev)


def _tensor_parallel(res, dry: bool, dev) -> None:
    import copy

    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from graphshard.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 1), nn.Flatten(0)).to(dev)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh(dev.type, (1,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    losses, ref_losses = _train(model, dev), _train(ref, dev)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    _compare(res, "tensor_parallel", losses, ref_losses, state, ref.state_dict(), dev)


def run(res, dry: bool) -> None:
    import torch
    import torch.distributed as dist

    from check_common import device, reset_compile_state

    dev = device(dry)
    if dry:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        torch.cuda.set_device(dev)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    res.line(f"- process group {dist.get_backend()!r}, world 1, device {dev}")
    for name, fn in (("fsdp_cpu_built", lambda: _fsdp(res, dry, dev, meta=False)),
                     ("fsdp_meta", lambda: _fsdp(res, dry, dev, meta=True)),
                     ("tensor_parallel", lambda: _tensor_parallel(res, dry, dev))):
        with res.part(name):
            res.need(10)
            fn()
        reset_compile_state()
