"""The layout rules of ``docs/design/overview.md`` ("Layout: who imports whom"), read from the source.

- no import cycle between graphshard's modules, counting imports inside functions (a lazy import
  that breaks a cycle at load time still ties the two modules together);
- no import cycle between its packages either (``compiler`` -> ``passes`` -> ``compiler`` through
  two different modules is a loop the per-module check cannot see): ``passes/`` never imports
  ``compiler/``;
- no module imports another package's private name (``from graphshard.x.y import _helper``);
- every ``graphshard::`` op is defined in ``graphshard/ops/``.

Each rule is also checked against a planted violation, so a rule that can never fire fails here.
"""

from __future__ import annotations

import ast
import os
import re

import graphshard

def _modules() -> dict[str, str]:
    """Module name -> source, for every module graphshard ships."""
    import graphshard.kernels
    import graphshard.passes

    roots = {"graphshard": os.path.dirname(graphshard.__file__),
             "graphshard.passes": os.path.dirname(graphshard.passes.__file__),
             "graphshard.kernels": os.path.dirname(graphshard.kernels.__file__)}
    out = {}
    for pkg, root in roots.items():
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                rel = rel.removesuffix("__init__").rstrip(".")
                name = f"{pkg}.{rel}" if rel else pkg
                if name not in out:
                    with open(os.path.join(dirpath, f)) as fh:
                        out[name] = fh.read()
    return out


def _is_package(name: str, modules: dict[str, str]) -> bool:
    return any(m.startswith(name + ".") for m in modules)


def _imports(name: str, source: str, modules: dict[str, str]) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import of a graphshard module in
    ``source``, at module level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            names = [a.name for a in node.names if f"{target}.{a.name}" not in modules]
            out += [(s, [], node.lineno) for s in subs]
            if names:
                out.append((target, names, node.lineno))
    return [(t, n, line) for t, n, line in out if t.startswith("graphshard")]


def _owner(target: str, modules: dict[str, str]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_cycles(modules: dict[str, str], unit=lambda m, modules: m) -> list[list[str]]:
    """The strongly connected components (more than one member) of the import graph, its members
    the modules, or what ``unit`` maps each module to (`import_cycles_between_packages`)."""
    graph = {unit(m, modules): set() for m in modules}
    for m, src in modules.items():
        for target, _, _ in _imports(m, src, modules):
            owner = _owner(target, modules)
            if owner and owner != m and not m.startswith(owner + "."):  # a package's own parents load first anyway
                a, b = unit(m, modules), unit(owner, modules)
                if a != b:
                    graph[a].add(b)
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _top_package(module: str, modules: dict[str, str]) -> str:
    """``graphshard.compiler`` for any module under it; a top-level module (``graphshard.storage``)
    is its own."""
    top = ".".join(module.split(".")[:2])
    return top if top != module or _is_package(top, modules) else module


def import_cycles_between_packages(modules: dict[str, str]) -> list[list[str]]:
    return import_cycles(modules, _top_package)


def _package(module: str, modules: dict[str, str]) -> str:
    return module if _is_package(module, modules) else module.rpartition(".")[0]


_SHARED_PRIVATE = {"graphshard._compat"}
"""Private modules every package may import: ``_compat`` is the one door to torch's private APIs."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules: dict[str, str]) -> list[str]:
    """``module:line imports <what> from <module>`` for a private name taken from any other module,
    and for a private module (``pkg._helpers``) of another package."""
    out = []
    for m, src in modules.items():
        for target, names, line in _imports(m, src, modules):
            owner = _owner(target, modules)
            if owner is None or owner == m or owner in _SHARED_PRIVATE:
                continue
            other_package = _package(owner, modules) != _package(m, modules)
            private_module = any(_private(part) for part in owner.split(".")[1:])
            for n in names or [owner.rpartition(".")[2]]:
                if (names and _private(n)) or (private_module and other_package):
                    out.append(f"{m}:{line} imports {n} from {owner}")
    return out


_OP_DEFINITION = re.compile(r"""custom_op\(\s*["']graphshard::|Library\(\s*["']graphshard["']|"""
                            r"""register_fake\(\s*["']graphshard::|define\(\s*["']graphshard::""")


def op_definitions_outside_ops(modules: dict[str, str]) -> list[str]:
    return sorted(m for m, src in modules.items()
                  if _OP_DEFINITION.search(src) and not m.startswith("graphshard.ops"))


def test_no_import_cycles():
    assert import_cycles(_modules()) == []


def test_no_import_cycles_between_packages():
    assert import_cycles_between_packages(_modules()) == []


def test_no_private_names_across_packages():
    assert private_imports(_modules()) == []


def test_every_graphshard_op_is_defined_in_graphshard_ops():
    assert op_definitions_outside_ops(_modules()) == []


def test_the_rules_fire_on_planted_violations():
    modules = _modules()
    planted = dict(modules)
    planted["graphshard.plan"] += "\ndef _f():\n    from graphshard.storage import shard\n"  # storage imports plan
    planted["graphshard.planning.cost"] += "\nfrom graphshard.compiler.backend import _trace_to_aten\n"
    planted["graphshard.compiler.lowering"] += "\nfrom graphshard.compiler.prepare import _strip_dtensor_boundary\n"
    planted["graphshard.planning.auto_plan"] += "\nfrom graphshard.frontends.fsdp._common import clean_fqn\n"
    planted["graphshard.sparse.layout"] += '\nlib = torch.library.Library("graphshard", "FRAGMENT")\n'
    assert any({"graphshard.plan", "graphshard.storage"} <= set(c) for c in import_cycles(planted))
    assert import_cycles_between_packages(modules) == []
    # passes -> compiler, where compiler's modules import passes: no module cycle, one package cycle
    loop = modules | {"graphshard.passes.context": modules["graphshard.passes.context"]
                      + "\nfrom graphshard.compiler.explain import explain\n"}
    assert import_cycles(loop) == []
    assert import_cycles_between_packages(loop) == [["graphshard.compiler", "graphshard.passes"]]
    found = private_imports(planted)
    assert {"_trace_to_aten", "_strip_dtensor_boundary", "clean_fqn"} <= {v.split()[2] for v in found}
    assert op_definitions_outside_ops(planted) == ["graphshard.sparse.layout"]


def test_public_frontend_paths_name_the_frontend_modules_themselves():
    import graphshard.fsdp
    import graphshard.fsdp.wrap
    import graphshard.frontends.fsdp._wrapper as wrapper
    import graphshard.model_parallel
    import graphshard.tensor_parallel
    from graphshard import frontends

    assert graphshard.fsdp is frontends.fsdp and graphshard.fsdp.wrap is frontends.fsdp.wrap
    assert graphshard.model_parallel is frontends.model_parallel
    assert graphshard.tensor_parallel is frontends.tensor_parallel
    assert graphshard.fsdp.FullyShardedDataParallel is wrapper.FullyShardedDataParallel
