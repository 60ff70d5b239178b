"""The torch.compile backend: registration, recompiles, explain, mixed precision."""

import re
import subprocess
import sys
import time

import torch
from expecttest import TestCase

import graphshard
from _golden import compiled_stages
from _models import fsdp_plan, mesh1d, mlp, stack
from graphshard._compat import dynamo_counters


def test_backend_registered_by_entry_point_without_importing_graphshard():
    code = "import torch\nfrom torch._dynamo import list_backends\nprint('graphshard' in list_backends())\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr
    code = "import torch, sys\nfrom torch._dynamo import lookup_backend\nfn = lookup_backend('graphshard')\nprint(fn.__module__)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "graphshard.compiler.backend", out.stderr


def test_no_recompile_over_steps_and_no_graph_breaks():
    dynamo_counters().clear()
    model = mlp()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert dynamo_counters()["stats"]["unique_graphs"] == 1
    assert sum(dynamo_counters()["graph_break"].values()) == 0


def test_shared_compile_claims_work_by_content_and_waits_only_for_claimed_work():
    # Two local ranks on one store: each piece of work (named by its content) goes to the
    # first rank that claims it; the other waits for it only until the claimer says it is
    # done, and at most its bound, after which it compiles the work itself. Work nobody
    # else claimed is never waited for: the claim wins at once.
    from graphshard.compiler.compile_share import SharedCompile

    store = torch.distributed.HashStore()
    first, second = SharedCompile(store, "node0/"), SharedCompile(store, "node0/", wait_s=0.2)
    assert first.claim("region-a") and not second.claim("region-a")
    assert second.claim("region-b") and not first.claim("region-b")
    assert second.claim("only-on-second")  # a graph compiled by one rank only
    assert not second.wait("region-a", second.deadline())  # claimed, not done: the bound expires
    assert not second.wait("region-a", 0.0)  # a deadline already past returns at once
    first.done("region-a")
    assert second.wait("region-a", second.deadline())
    assert SharedCompile(store, "node1/").claim("region-a")  # another machine claims apart


def test_torch_compile_by_backend_name_on_a_prepared_model():
    model = graphshard.shard(mlp(), graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}))
    compiled = torch.compile(model, backend="graphshard", options={"lower": "eager"})
    compiled(torch.randn(4, 16)).sum().backward()
    assert len(model._graphshard.explain) == 1
    assert any(c.kind == "all_gather" for c in model._graphshard.explain[0].collectives)


def test_explain_splits_the_compiling_call_into_dynamo_backend_and_first_run():
    # The call that compiles a graph is dynamo's own work (trace, guards), the backend's and the
    # compiled graph's first run. explain keeps the three apart, and together they are the call's
    # time measured here, outside graphshard.
    model = mlp()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    start = time.perf_counter()
    model(torch.randn(4, 16)).sum().backward()
    wall = time.perf_counter() - start
    (report,) = model._graphshard.explain
    dynamo = report.compile_seconds["dynamo"]
    assert dynamo > 0 and report.backend_seconds > 0 and report.first_run_seconds > 0
    assert report.compile_seconds["trace_to_aten"] < report.backend_seconds  # a phase of the backend
    assert dynamo + report.backend_seconds + report.first_run_seconds <= wall
    assert "dynamo " in graphshard.explain(model)
    model(torch.randn(4, 16)).sum().backward()  # no compile: nothing changes
    assert report.compile_seconds["dynamo"] == dynamo and len(model._graphshard.explain) == 1


class TestExplainAndMixedPrecision(TestCase):
    def test_explain_report(self):
        model = stack()
        compiled_stages(model, fsdp_plan(), (torch.randn(4, 8),))
        text = graphshard.explain(model)
        self.assertIn("layers.1: 1 parameters (layers.1.weight)", text)
        self.assertIn("all_gather      axis=dp", text)
        self.assertIn("reduce_scatter  axis=dp", text)
        self.assertIn("order after scheduling (forward): all_gather(layers.0)", text)
        self.assertIn("fallbacks: none", text)

    def test_param_dtype_casts_before_gather_and_reduces_in_reduce_dtype(self):
        spec = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        g = compiled_stages(stack(), fsdp_plan(**spec), (torch.randn(4, 8, dtype=torch.bfloat16),))
        fw = g["forward"]
        # the local fp32 shard is cast to bf16 as it is packed, then gathered as bf16; nothing in fp32
        shard = re.search(r'(primals_\d+): "f32\[2, 8\]"', fw)
        self.assertIsNotNone(shard, fw)
        self.assertRegex(fw, r'pack: "bf16\[16\]" = torch\.ops\.graphshard\.pack\.default\(\[' + shard[1] +
                         r'\], \[16\], torch\.bfloat16\)')
        self.assertRegex(fw, r'"bf16\[64\]" = torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\(pack, 4, ')
        self.assertNotRegex(fw, r'"f32\[\d+\]" = torch\.ops\._c10d_functional\.all_gather')
        bw = g["backward"]
        self.assertRegex(bw, r'"f32\[16\]" = torch.ops._c10d_functional.reduce_scatter_tensor')

    def test_strict_mode_names_op_without_rule(self):
        from torch.distributed.tensor import Shard

        class Odd(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(8, 8)

            def forward(self, x):
                return torch.cumsum(self.fc(x), dim=1)

        torch.manual_seed(0)
        plan = graphshard.Plan(mesh1d("tp"), {"fc": graphshard.ShardParams("tp", weight=Shard(0), bias=Shard(0))})
        model = Odd()
        graphshard.compile(model, plan, lower="eager", strict=True)
        with self.assertRaisesRegex(Exception, r"no placement rule for aten.cumsum.default \(node 'cumsum'\)"):
            model(torch.randn(2, 8))
        torch._dynamo.reset()
        model2 = Odd()
        graphshard.compile(model2, plan, lower="eager")
        model2(torch.randn(2, 8))
        self.assertIn("aten.cumsum.default at node 'cumsum': no placement rule", graphshard.explain(model2))


def test_dtensor_boundary_gives_each_parameter_its_gradient_as_a_dtensor():
    # The compiled function's inputs are the parameters' local tensors, taken through one
    # autograd node; each gradient comes back as a DTensor with its parameter's spec, and a
    # frozen parameter's local tensor takes no gradient.
    from torch.distributed.tensor import DTensor

    from graphshard._compat import local_tensors

    model = mlp()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()}), lower="eager")
    model.fc2.bias.requires_grad_(False)
    params = dict(model.named_parameters())
    locals_ = local_tensors(list(params.values()))
    for (name, p), local in zip(params.items(), locals_):
        assert torch.equal(local, p.to_local()) and local.requires_grad == p.requires_grad, name
        assert local.data_ptr() == p.to_local().data_ptr(), name  # an alias, not a copy
    torch.autograd.backward([t for t in locals_ if t.requires_grad],
                            [torch.full_like(t, i + 1.0) for i, t in enumerate(locals_) if t.requires_grad])

    def check(expected_value):
        for i, (name, p) in enumerate(params.items()):
            if not p.requires_grad:
                assert p.grad is None, name
                continue
            assert isinstance(p.grad, DTensor), name
            assert (p.grad.placements, p.grad.shape, p.grad.device_mesh) == (p.placements, p.shape, p.device_mesh), name
            if expected_value:
                assert torch.equal(p.grad.to_local(), torch.full_like(p.to_local(), i + 1.0)), name

    check(expected_value=True)
    model.zero_grad()
    model(torch.randn(4, 16)).sum().backward()  # the same boundary, inside the compiled model
    check(expected_value=False)


def test_graphshard_compile_hands_dynamo_plain_local_shards():
    # graphshard's call wrapper feeds the getters each parameter's local shard, so dynamo guards
    # plain tensors; compiled by name, dynamo gets the DTensors and explain says so. Both give the
    # same loss and gradients, and the fed shards are let go after the call.
    plan = graphshard.Plan(mesh1d("dp"), {"": graphshard.FullyShard()})
    fed, by_name = mlp(), graphshard.shard(mlp(), plan)
    graphshard.compile(fed, plan, lower="eager")
    compiled_by_name = torch.compile(by_name, backend="graphshard", options={"lower": "eager"})
    x = torch.randn(4, 16)
    for _ in range(2):
        losses = [m(x).square().mean() for m in (fed, compiled_by_name)]
        for loss in losses:
            loss.backward()
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])
    for (name, p), q in zip(fed.named_parameters(), by_name.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad.to_local()).all(), name
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name
    as_dtensors = [[n for n in r.notes if "reached dynamo as DTensors" in n] for m in (fed, by_name)
                   for r in m._graphshard.explain]
    assert as_dtensors == [[], [f"{len(list(by_name.parameters()))} parameter input(s) reached dynamo as DTensors "
                                "(a model compiled by name, or a separately sharded submodule): dynamo checks each "
                                "one's spec and mesh in Python at every call; graphshard.compile and the frontends "
                                "hand dynamo plain local shards"]]
    assert len(fed._graphshard.explain) == 1  # the second step compiled nothing: the fed shards pass the guards
    assert fed._graphshard.fed_locals == {}
    assert all(not m.__dict__.get("_graphshard_locals") for m in fed.modules())


class _LearnedBiasAttention(torch.nn.Module):
    """Attention whose mask is a learned bias (T5's relative position bias): a mask that
    requires grad."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48, bias=False)
        self.bias = torch.nn.Parameter(0.1 * torch.randn(1, 4, 8, 8))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).sum()


def test_attention_with_a_mask_that_requires_grad_compiles():
    # The trace to ATen ran under no_grad, so attention picked the fused CPU kernel, which
    # takes no gradient for its mask; aot_autograd's trace with autograd then raised. The
    # trace now has the real call's grad facts, and the mask's parameter gets its gradient.
    torch.manual_seed(0)
    ref = _LearnedBiasAttention()
    model = _LearnedBiasAttention()
    model.load_state_dict(ref.state_dict())
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.Replicate()}), lower="eager")
    x = torch.randn(2, 8, 16)
    loss = model(x)
    loss.backward()
    ref_loss = ref(x)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    # the mask's gradient and the projection's, as plain torch computes them (Replicate's gradient
    # average over the fake group's 4 identical ranks is the gradient itself)
    for name in ("bias", "qkv.weight"):
        got = model.get_parameter(name).grad
        got = got.full_tensor() if isinstance(got, torch.distributed.tensor.DTensor) else got
        torch.testing.assert_close(got, ref.get_parameter(name).grad, msg=name)


def test_a_fake_tensor_failure_stops_the_compile_instead_of_running_eagerly():
    # dynamo answers a backend's fake-tensor errors (an op with data-dependent output sizes the
    # graph cannot hold, an op without a fake impl) with a graph break and an eager run of the
    # graph, nothing sharded: graphshard turns them into an error that says so
    import pytest
    import torch.fx as fx

    from graphshard.compiler.backend import graphshard_backend

    gm = fx.symbolic_trace(lambda x: torch.nonzero(x))  # sizes only the data knows; no shape env to hold them
    with pytest.raises(RuntimeError, match=r"(?s)graphshard could not trace this graph \(DynamicOutputShapeException.*silent fallback"):
        graphshard_backend(gm, [torch.tensor([0.0, 1.0])])


_NO_DERIVATIVE_LIB = None


def _op_without_derivative():
    """``gstest::twice``: a custom op with CPU and fake kernels and no autograd kernel, as fbgemm's
    ``permute_pooled_embs`` is (its gradient lives in a C++ wrapper op the ATen trace goes below)."""
    global _NO_DERIVATIVE_LIB
    if _NO_DERIVATIVE_LIB is None:
        lib = torch.library.Library("gstest", "DEF")
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CPU")
        torch.library.register_fake("gstest::twice", lambda x: torch.empty_like(x), lib=lib)
        _NO_DERIVATIVE_LIB = lib
    return torch.ops.gstest.twice


def test_an_op_without_a_derivative_is_an_error_not_a_dropped_gradient():
    # torch's autograd fallback only warns and gives the op's inputs no gradient: the layer before it
    # would silently stop training. The compile refuses, naming the op.
    import pytest

    twice = _op_without_derivative()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return twice(self.lin(x)).sum()

    model = Model()
    graphshard.compile(model, graphshard.Plan(mesh1d("dp"), {"": graphshard.Replicate()}), lower="eager")
    with pytest.raises(Exception, match=r"differentiates an op with no derivative.*gstest::twice: an autograd kernel "
                                        r"was not registered"):
        model(torch.randn(2, 4))
