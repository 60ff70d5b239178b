"""graphshard's compiled programs in torch's AOTAutogradCache (``CompileConfig.program_cache``).

A second process on the same model and plan would otherwise differentiate, partition, schedule
and lower its graphs again: only Inductor's kernels come from the on-disk cache. Here the
backend's stage compilers return a `StageProgram`, an Inductor ``OutputCode`` that aot_autograd
bundles into its cache entry with its own runtime metadata (input mutations, aliased outputs,
saved tensors). A later process whose graph has the same key loads the entry instead of calling
the partitioner and the compilers: the lowered programs come back with their compiled regions
(`lowering.RegionalProgram` pickles itself), and what graphshard wraps around them (the
collective check, ``no_sync``'s programs) is rebuilt from the data stored with them.

The key is aot_autograd's (the graph graphshard hands it, its inputs, torch's and Inductor's
settings) plus `key_tag`: the record the compile reads (the pass context with the sharded models,
walked field by field: `graphshard.fingerprint`), node metadata, rank and world, and graphshard's
own source. A loaded program checks its inputs at its first call (`verified`). What is still done in a second process, and why: dynamo (its guards
are the process's own), the trace to ATen and the pre-autograd passes (the key is computed from
their result), and the outline of repeated blocks (it rewrites the graph the key is taken of).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import re
import time
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from graphshard import _compat, fingerprint
from graphshard.report import GraphReport
from graphshard.compiler.inductor_cpu import ISA_SPLIT_NOTE
from graphshard.compiler.outline import BODY

log = logging.getLogger(__name__)

VERSION = "1"
"""Part of every key: bump it when what a stored program holds changes."""

CACHEABLE_FUNCTIONS = {"graphshard.compiler.outline.call_body": VERSION}
"""Plain functions in the graph handed to aot_autograd (an outlined block's call), allowed in its
cache: what they do is graphshard's source, which `key_tag` covers."""

# Node metadata that aot_autograd's key already covers (fake values: the graph's code and inputs fix
# them) or that holds per-process objects; every other key is part of `key_tag`.
_UNKEYED_META = frozenset({"val", "tensor_meta", "example_value", "eager_input_vals", "from_node",
                           "seq_nr", "source_fn_stack", "nn_module_stack", "fwd_nn_module_stack",
                           "fwd_source_fn_stack", "original_aten", "torch_fn"})
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

BACKWARD_META = frozenset({"val", "tensor_meta", "stack_trace", "original_aten", "seq_nr", BODY})
"""The node metadata a stored backward graph keeps: what deriving ``no_sync``'s programs from it and
lowering them read (fake values, source lines, the trace-once body for explain)."""


def supported(config) -> str | None:
    """Why the program cache cannot serve this compile, or None when it can."""
    if not _compat.HAS_PROGRAM_CACHE:
        return f"torch {_compat.TORCH_VERSION[0]}.{_compat.TORCH_VERSION[1]} cannot bundle a compiler's own program (2.13 can)"
    if config.lower != "inductor":
        return f"lower={config.lower!r} compiles nothing to keep"
    if not _compat.inductor_fx_graph_cache_enabled():
        return "Inductor's on-disk caches are off"
    if _compat.inductor_cudagraphs_enabled():
        return "Inductor's CUDA graphs are on: a stored program keeps no CUDA graph of its regions"
    return None


@functools.cache
def source_digest() -> str:
    """graphshard's own code: a stored program is valid for the source that compiled it."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for package in ("graphshard", "passes", "kernels"):
        for folder, dirs, files in sorted(os.walk(os.path.join(root, package))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def key_tag(gm: fx.GraphModule, ctx, rank: tuple[int, int] | None) -> str:
    """What aot_autograd's key leaves out of a program graphshard compiles, taken of the record the
    compile reads: the pass context (`passes.context.PassContext`: the compile config, the sharded
    models with every parameter's logical size, dtype, placements, mesh, unit and unit spec, the plan,
    the axes with their process groups, backends and collective forms, the embedding collections,
    the units and grad modes of the inputs), walked field by field (`graphshard.fingerprint`: a
    field is keyed unless declared unkeyed with the reason, and a value of an unknown type is an
    error); each node's metadata (recompute tags, trace-once marks, placements: ``GraphModule``
    pickles without it); the process's (rank, world size); torch's version, graphshard's source and
    this module's `VERSION`.

    The graph alone does not fix the program: graphshard's ops carry parameter keys, and their
    decompositions read the parameter's record while aot_autograd traces (its reduction dtype, its
    collective form, its logical size), which happens only when the cache misses. The rank, because
    ranks whose forward graphs are the same may differentiate them into different backwards: gloo's
    reduce-scatter is an all-to-all whose split sizes are the rank's."""
    h = hashlib.sha256()
    h.update(f"{VERSION}|{source_digest()}|{torch.__version__}|{rank}|".encode())
    h.update(repr(fingerprint.canonical(ctx, "the pass context")).encode())
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for n in module.graph.nodes:
                meta = sorted((k, _ADDRESS.sub("", repr(v))) for k, v in n.meta.items() if k not in _UNKEYED_META)
                h.update(f"{n.name}{meta!r}".encode())
    return f"graphshard-program-{h.hexdigest()[:40]}"


class ReportDelta:
    """What a stage's compile added to explain's report (the partition's scheduling, the lowering's
    order and regions, notes and fallbacks), kept with the stored program and added again to the
    report of the compile that loads it. Timings are the compile's own and are not kept."""

    LISTS = ("collectives", "fallbacks", "notes")
    PER_PROCESS = (ISA_SPLIT_NOTE,)  # notes on what this process did, not the program: not kept
    DICTS = ("order", "schedule", "lowered_order", "regions", "recompute")

    def __init__(self, report: GraphReport):
        self.report = report
        self.mark()

    def mark(self) -> None:
        self.lengths = {name: len(getattr(self.report, name)) for name in self.LISTS}
        self.dicts = {name: dict(getattr(self.report, name)) for name in self.DICTS}

    def take(self) -> dict[str, Any]:
        """What was added since the last mark; marks again."""
        added: dict[str, Any] = {name: list(getattr(self.report, name)[n:]) for name, n in self.lengths.items()}
        added["notes"] = [n for n in added["notes"] if not n.startswith(self.PER_PROCESS)]
        for name, before in self.dicts.items():
            added[name] = {k: v for k, v in getattr(self.report, name).items() if before.get(k) is not v}
        self.mark()
        return added


def apply_delta(report: GraphReport, added: dict[str, Any]) -> None:
    """``added`` (`ReportDelta.take`) put in ``report``; a fallback is logged again, as its pass did."""
    for fallback in added.get("fallbacks", ()):
        log.warning("graphshard: %s (in a program loaded from the cache)", fallback)
    for name in ReportDelta.LISTS:
        getattr(report, name).extend(added.get(name, ()))
    for name in ReportDelta.DICTS:
        getattr(report, name).update(added.get(name, {}))


class StageProgram(_compat.output_code_base()):
    """A lowered forward or backward program as aot_autograd's cache keeps it (an Inductor
    ``OutputCode``, boxed calling convention).

    * ``lowered``: the program as lowered (a `lowering.RegionalProgram`, or Inductor's compiled
      graph for a graph lowered whole);
    * ``by_group``: the collective check's fingerprint (`collective_check.fingerprint`), or None;
    * ``backward``: the partitioned backward graph, kept when ``no_sync`` may derive programs from
      it (stored as bytes, loaded on ``no_sync``'s first use);
    * ``report``: what the stage's compile added to explain's report (`ReportDelta`);
    * ``signature``: the shape and dtype of each input it was compiled for (`signature`), which a
      loaded program checks at its first call (`verified`).

    ``run`` is the program with graphshard's wrappers; a loaded one gets them again from the
    compile that loads it (`loading`)."""

    def __init__(self, stage: str, lowered: Callable, run: Callable, *, by_group: dict | None,
                 backward: fx.GraphModule | None, report: dict[str, Any], seconds: float, signature: list):
        if _compat.HAS_PROGRAM_CACHE:
            super().__init__()
        self.stage, self.lowered, self.by_group, self.backward, self.report = stage, lowered, by_group, backward, report
        self.signature = signature
        self.run = run
        self._boxed_call = True
        self._time_taken_ns = int(seconds * 1e9)  # the compile a load saves (aot_autograd's cache statistics)

    def __call__(self, inputs: list) -> Any:
        return self.run(inputs)

    def prepare_for_serialization(self) -> None:
        """On aot_autograd's copy of the entry, before it is pickled."""
        self.run = None
        if _compat.is_output_code(self.lowered):
            self.lowered = _compat.stored_compiled_graph(self.lowered)
        if isinstance(self.backward, fx.GraphModule):
            self.backward = _compat.graph_to_bytes(self.backward, BACKWARD_META)

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        """On a load: the program's regions are loaded (unpickling did it); reports its output
        strides to aot_autograd, as its lowering did, and gets graphshard's wrappers back."""
        load = _LOADING.get()
        if load is None:
            raise RuntimeError("graphshard: a program from torch's AOTAutogradCache was loaded outside graphshard's "
                               "backend (torch.compile's precompile or another backend's cache), which cannot rebuild it")
        if _compat.is_output_code(self.lowered):
            self.lowered = _compat.load_whole_graph(self.lowered, example_inputs, self.stage == "backward")
        elif getattr(self.lowered, "output_strides", None) is not None:
            _compat.report_output_strides(self.lowered.output_strides)
        load(self)

    def backward_graph(self) -> fx.GraphModule:
        if isinstance(self.backward, bytes):
            self.backward = _compat.graph_from_bytes(self.backward)
        return self.backward


def signature(inputs) -> list:
    """Each of a stage's inputs as (shape, dtype), a symbolic size as None; None for a non-tensor."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            out.append((tuple(d if isinstance(d, int) else None for d in x.shape), str(x.dtype)))
        else:
            out.append(None)
    return out


class StaleProgram(RuntimeError):
    """A program loaded from the cache was fed inputs other than those it was compiled for."""


def verified(fn: Callable, expected: list, stage: str, graph: int) -> Callable:
    """``fn`` (a loaded program, boxed), refusing at its first call to run on inputs whose shapes
    or dtypes are not those it was compiled for (`signature`). The key should make that impossible;
    this is the cheap check that a stale entry cannot train in its place. Later calls pay a flag test:
    dynamo's guards keep the inputs' shapes and dtypes."""
    pending = True

    def run(inputs: list):
        nonlocal pending
        if pending:
            got = signature(inputs)
            bad = next((i for i, (g, e) in enumerate(zip(got, expected)) if not _fits(g, e)), None)
            if len(got) != len(expected) or bad is not None:
                what = (f"{len(got)} inputs where it was compiled for {len(expected)}" if bad is None else
                        f"input {bad} as {got[bad]} where it was compiled for {expected[bad]}")
                raise StaleProgram(
                    f"graphshard: the {stage} program of graph {graph} loaded from torch's AOTAutogradCache was fed "
                    f"{what} (shape, dtype): the stored program was compiled for another model or setting and its "
                    "key did not tell them apart. Report it; meanwhile compile with program_cache=False or clear "
                    "the Inductor cache (TORCHINDUCTOR_CACHE_DIR)")
            pending = False
        return fn(inputs)

    run._boxed_call = True
    return run


def _fits(got, expected) -> bool:
    if got is None or expected is None:
        return got is expected
    (gs, gd), (es, ed) = got, expected
    return gd == ed and len(gs) == len(es) and all(e is None or g == e for g, e in zip(gs, es))


def stored_steps(program: list[tuple]) -> list[tuple]:
    """A `lowering.RegionalProgram`'s steps as data: each distinct compiled region as Inductor's
    compiled graph fit to pickle (`_compat.stored_compiled_graph`), each op by its name; eager
    regions, the in-place collectives' objects and plain functions pickle as they are."""
    stored: dict[int, _StoredRegion] = {}  # the layers' regions share a few compiled graphs: each stored once

    def store(fn):
        if _compat.is_op_overload(fn):
            return _OpName(fn.name())  # "namespace::op.overload"
        if not _compat.is_output_code(fn):
            return fn
        if id(fn) not in stored:
            stored[id(fn)] = _StoredRegion(_compat.stored_compiled_graph(fn))
        return stored[id(fn)]

    return [(kind, store(fn), *rest) for kind, fn, *rest in program]


def loaded_steps(program: list[tuple], is_backward: bool) -> list[tuple]:
    """`stored_steps`' steps runnable again: each compiled region loaded once (`_compat.load_compiled_graph`)."""
    loaded: dict[int, Callable] = {}

    def load(fn):
        if isinstance(fn, _OpName):
            return fn.resolve()
        if isinstance(fn, _StoredRegion):
            if id(fn) not in loaded:
                loaded[id(fn)] = _compat.load_compiled_graph(fn.graph, is_backward)
            return loaded[id(fn)]
        return fn

    return [(kind, load(fn), *rest) for kind, fn, *rest in program]


class _OpName:
    """An operator in a stored program, by its qualified name (``OpOverload``s do not pickle)."""

    def __init__(self, name: str):
        self.name = name

    def resolve(self):
        namespace, rest = self.name.split("::")
        op, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


class _StoredRegion:
    """A compiled region in a stored program: Inductor's compiled graph, loaded with the program."""

    def __init__(self, graph):
        self.graph = graph


_LOADING: contextvars.ContextVar[Callable[[StageProgram], None] | None] = contextvars.ContextVar(
    "graphshard_program_loading", default=None)


@contextlib.contextmanager
def loading(rebuild: Callable[[StageProgram], None]) -> Iterator[None]:
    """Within the context, a `StageProgram` aot_autograd loads is handed to ``rebuild`` (the
    backend's, which puts graphshard's wrappers back and its report in place)."""
    token = _LOADING.set(rebuild)
    try:
        yield
    finally:
        _LOADING.reset(token)


class Outcome:
    """What the cache did for one compile, from aot_autograd's counters (read before and after)."""

    def __init__(self):
        self.before = _compat.autograd_cache_counts()
        self.start = time.perf_counter()

    def describe(self) -> tuple[str, bool]:
        after = _compat.autograd_cache_counts()
        seconds = time.perf_counter() - self.start
        d = {k: after[k] - self.before[k] for k in after}
        if d["hit"]:
            return (f"program cache: loaded from torch's AOTAutogradCache in {seconds:.2f} s (aot_autograd, the "
                    "post-partition passes and lowering skipped)"), True
        if d["saved"]:
            return "program cache: compiled and stored in torch's AOTAutogradCache", False
        if d["bypass"]:
            return ("program cache: bypassed by torch's AOTAutogradCache (a node or setting it cannot key; "
                    "TORCH_LOGS=+torch._functorch._aot_autograd.autograd_cache names it): compiled, not stored"), False
        return "program cache: compiled, not stored (torch's AOTAutogradCache did not save the entry)", False
