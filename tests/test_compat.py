"""The private torch APIs graphshard uses (``graphshard/_api_probe.py``): all there on the installed
torch, the probe able to say that one is not, the declared list covering the code; and the
version gates of ``graphshard/_compat.py``."""

from __future__ import annotations

import ast
import os

import torch

from graphshard import _api_probe as probe
from graphshard import _compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_private_api_is_present():
    """Every one graphshard needs; a gated one (graphshard does without it) may be missing."""
    missing = probe.missing_private_apis(gated=True)
    for name, why in missing.items():
        print(f"torch {torch.__version__} lacks {name}: {why}")
    needed = {name: why for name, why in missing.items() if "[gated: " not in why}
    assert not needed, f"torch {torch.__version__} lacks {len(needed)} private API(s) graphshard uses: {needed}"


def test_probe_reports_what_is_missing():
    made_up = [
        "torch._graphshard_no_such_module.fn",                                   # module
        "torch._inductor.graphshard_no_such_attr",                               # attribute
        "torch.ops.aten._graphshard_no_such_op.default",                         # op
        "torch._inductor.config[cpp.graphshard_no_such_key]",                    # config key
        "torch.fx.experimental.symbolic_shapes.ShapeEnvSettings{graphshard_no}",  # dataclass field
        "torch._guards.TracingContext().graphshard_no_such_attr",                # instance attribute
        "torch.distributed.tensor.DTensor.from_local(graphshard_no=)",           # keyword argument
        "torch.distributed.tensor.placement_types._StridedShard(graphshard_no=)",  # C++ class's keyword
        'torch._inductor.graph:"graphshard_no_such_text"',                       # source text
    ]
    apis = tuple(probe.PrivateAPI(n, "tests/test_compat.py") for n in made_up)
    result = probe.probe_private_apis(apis)
    assert list(result) == made_up
    assert all(isinstance(why, str) and why for why in result.values()), result
    missing = probe.missing_private_apis(apis)
    assert set(missing) == set(made_up)
    assert all(why.endswith("(used by tests/test_compat.py)") for why in missing.values())
    gated = (probe.PrivateAPI("torch._graphshard_no_such_fn", "x", "done without"),)
    assert probe.missing_private_apis(gated) == {}
    assert probe.missing_private_apis(gated, gated=True)["torch._graphshard_no_such_fn"].endswith(
        "[gated: done without] (used by x)")
    # and the same forms on names that exist are reported present
    real = ("torch._inductor.config", "torch.ops.aten._to_copy.default", "torch._inductor.config[cpp.vec_isa_ok]",
            "torch.distributed.tensor.placement_types._StridedShard(split_factor=)")
    assert probe.probe_private_apis(tuple(probe.PrivateAPI(n, "x") for n in real)) == dict.fromkeys(real)


def test_inplace_op_by_tag_or_schema():
    aten = torch.ops.aten
    inplace = [aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default, aten.exponential_.default,
               aten.add_.Tensor, aten.__iand__.Tensor]
    other = [aten.bernoulli.default, aten.add.Tensor, aten.rand.default, aten.copy.default, aten.__and__.Tensor]
    assert all(map(_compat.is_inplace_op, inplace)) and not any(map(_compat.is_inplace_op, other))
    # torch 2.11's way (no torch.Tag.inplace) agrees with the tag on every native op the tag marks
    assert all(map(_compat._inplace_by_schema, inplace)) and not any(map(_compat._inplace_by_schema, other))
    if hasattr(torch.Tag, "inplace"):
        ops = [getattr(packet, o) for packet in (getattr(aten, n) for n in dir(aten)
               if n.endswith("_") or n.startswith("__i")) if hasattr(packet, "overloads") for o in packet.overloads()]
        tagged = [op for op in ops if torch.Tag.inplace in op.tags]
        assert tagged and all(map(_compat._inplace_by_schema, tagged))


def test_to_local_in_either_form():
    """``p.to_local()`` as torch 2.13's dynamo records it and as torch 2.11's does."""
    import torch.fx as fx

    def prim(*args, **kwargs):  # torch 2.11's dynamo (TensorVariable.method_to_local)
        args_as_value, kwargs_as_value = list(args), dict(kwargs)

        def to_local_fn_with_prim_types(x):
            return x.to_local(*args_as_value, **kwargs_as_value)

        to_local_fn_with_prim_types.__name__ = "prim_to_local"
        return to_local_fn_with_prim_types

    g = fx.Graph()
    p = g.placeholder("p")
    nodes = [g.call_method("to_local", (p,)), g.call_function(prim(), (p,)),
             g.call_function(prim(grad_placements=("x",)), (p,)), g.call_function(torch.neg, (p,))]
    assert [_compat.is_plain_to_local(n) for n in nodes] == [True, True, False, False]


def test_declared_list_is_well_formed():
    names = [api.name for api in probe.PRIVATE_APIS]
    assert len(names) == len(set(names)), "a private API is declared twice"
    assert all(api.name.startswith("torch.") and api.used_by for api in probe.PRIVATE_APIS)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    rel = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
    return rel if rel.startswith("graphshard") else f"graphshard.{rel}"  # passes/, kernels/ ship inside


def _chain(node, aliases: dict[str, str]) -> str | None:
    """``node``'s dotted path when it is an attribute chain rooted at a name in ``aliases``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _module_aliases(tree) -> dict[str, str]:
    """Module-level names bound to a torch path (``aten = torch.ops.aten``)."""
    aliases = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and (chain := _chain(node.value, {"torch": "torch"})) is not None and chain != "torch"):
            aliases[node.targets[0].id] = chain
    return aliases


def _private_torch_paths(tree, exported: dict[str, dict[str, str]]) -> set[str]:
    """Dotted torch paths with a private component that a module imports or reads: its imports,
    and attribute chains rooted at ``torch`` or at a name bound to a torch path, here or in the
    graphshard module it imports the name from (``exported``: module -> its aliases)."""
    aliases = {"torch": "torch", **_module_aliases(tree)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "torch":
                found.update(f"{node.module}.{a.name}" for a in node.names)
            for a in node.names:
                if a.name in exported.get(node.module, {}):  # from graphshard.passes._graph import aten
                    aliases[a.asname or a.name] = exported[node.module][a.name]
                elif f"{node.module}.{a.name}" in exported:  # from graphshard import _compat
                    for name, chain in exported[f"{node.module}.{a.name}"].items():
                        aliases[f"{a.asname or a.name}.{name}"] = chain
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "torch")
        elif (isinstance(node, ast.Call) and _chain(node.func, {"importlib": "importlib"}) == "importlib.import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("torch")):
            found.add(node.args[0].value)  # a module loaded by name is reached all the same
    dotted = {k: v for k, v in aliases.items() if "." in k}  # _compat.c10d -> torch.ops._c10d_functional
    roots = {**aliases, **{k.split(".")[0]: k.split(".")[0] for k in dotted}}
    inner = set()  # attributes inside a longer chain: only the whole chain counts
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node not in inner:
            value = node.value
            while isinstance(value, ast.Attribute):
                inner.add(value)
                value = value.value
            if (chain := _chain(node, roots)) is None:
                continue
            for k, v in dotted.items():
                if chain == k or chain.startswith(k + "."):
                    chain = v + chain[len(k):]
            if chain.split(".")[0] == "torch":
                found.add(chain)
    return {p for p in found if any(part.startswith("_") and not part.startswith("__") for part in p.split("."))}


def _sources() -> dict[str, str]:
    paths = {}
    for top in ("graphshard", "passes", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            paths.update((os.path.join(dirpath, f), "") for f in files if f.endswith(".py"))
    return paths


def test_declared_list_covers_the_code():
    """Every private torch path graphshard/, passes/ and kernels/ name in code is declared (a
    declared name equal to it or extending it). Private attributes read off objects
    (``dtensor._local_tensor``) are not visible here: they are declared by hand."""
    declared = [api.name for api in probe.PRIVATE_APIS]
    trees = {path: ast.parse(open(path).read(), path) for path in _sources()}
    exported = {_module_name(path): _module_aliases(tree) for path, tree in trees.items()}
    undeclared: dict[str, list[str]] = {}
    for path, tree in trees.items():
        for p in _private_torch_paths(tree, exported):
            if not any(n == p or (n.startswith(p) and n[len(p)] in ".[{(:") for n in declared):
                undeclared.setdefault(p, []).append(os.path.relpath(path, ROOT))
    assert not undeclared, f"declare these in probe.PRIVATE_APIS: {undeclared}"


def test_a_module_loaded_by_name_is_seen_by_the_coverage_check():
    tree = ast.parse("import importlib\n\ndef f():\n    impl = importlib.import_module('torch._higher_order_ops.x')\n"
                     "    return impl.private_fn()\n")
    assert _private_torch_paths(tree, {}) == {"torch._higher_order_ops.x"}
