"""The stages aot_autograd drives: partition -> post-partition passes -> lower, and the wrappers
around each lowered program.

`compile_joint` hands the per-rank program to aot_autograd with two callbacks of a `Compilation`:

1. `Compilation.partition` (aot_autograd's ``partition_fn``): reads the joint graph; writes the
   forward and backward graphs, partitioned (the recompute tags honoured, an outlined block's body
   partitioned once: `recompute.partition_body`), the outlined calls put back in line, and the
   post-partition passes run on each (`passes.pipeline.post_partition_passes`).
2. `Compilation.lower` (aot_autograd's forward and backward compilers): reads one partitioned
   graph; writes a `Lowered`: the program Inductor (by region or whole) or FX (``lower="eager"``)
   made of it, with what the wrappers read.
3. The wrappers, applied in the order `STAGE_WRAPPERS` lists, to a program just lowered and to one
   loaded from the program cache alike (`Compilation.wrap`); the program cache stores what they
   need with the lowered program (`program_cache.StageProgram`) and rebuilds them on a load
   (`Compilation.rebuild`).

Compile sharing (`compile_share`: the local ranks split the regions to compile, and Inductor's
ISA check) lives inside the lowering: it changes who compiles a region, not what runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from graphshard import _compat
from graphshard.compiler import (collective_check, compile_share, experimental, grad_sync, inductor_cpu, outline,
                                 program_cache, recompute)
from graphshard.compiler.lowering import fuse_packed_gathers, lower_regions, plan_regions, whole_graph_reason
from graphshard.ops.dense import decompositions
from graphshard.passes.no_sync_programs import root_reductions
from graphshard.passes.pipeline import PassContext, dump_graph, post_partition_passes, run_passes
from graphshard.passes.relax_views import relax_views
from graphshard.report import add_compute, collective_kind

log = logging.getLogger(__name__)

# Inductor must keep the collective order that schedule_overlap chose.
INDUCTOR_SETTINGS = dict(reorder_for_locality=False, reorder_for_peak_memory=False)


def compile_joint(gm: fx.GraphModule, fake_inputs: list, ctx: PassContext, outlined: outline.Outlined,
                  ac_regions: dict[int, str]) -> Callable:
    """The per-rank program ``gm`` differentiated, partitioned, scheduled and lowered by aot_autograd
    with graphshard's stages; its programs looked up in and stored to the program cache when
    ``ctx.config.program_cache`` allows. Returns aot_autograd's compiled callable."""
    return Compilation(ctx, outlined, ac_regions).run(gm, fake_inputs)


@dataclass
class Lowered:
    """One stage's program as its lowering left it, and what the wrappers read."""

    stage: str                       # "forward" or "backward"
    program: Callable                # the lowered program (aot_autograd's boxed convention)
    by_group: dict | None = None     # the collective check's fingerprint of the graph (`collective_check`)
    no_sync: Callable | None = None  # () -> (backward graph, its data-parallel roots, inputs), for no_sync's programs
    kept_backward: object = None     # the backward graph (or its bytes) the program cache stores for no_sync
    start: float = field(default_factory=time.perf_counter)


def with_no_sync_programs(fn: Callable, lowered: Lowered, comp: "Compilation") -> Callable:
    """A backward with data-parallel gradient reductions runs as `grad_sync.GradSync`, which
    selects the program ``graphshard.no_sync`` needs (`passes.no_sync_programs`) per call."""
    if lowered.no_sync is None:
        return fn
    return grad_sync.GradSync(fn, lowered.no_sync, comp.ctx.models, comp.lower_variant, dump=_variant_dump(comp.ctx))


def with_collective_check(fn: Callable, lowered: Lowered, comp: "Compilation") -> Callable:
    """Before a program's first call, the ranks compare the collectives it will issue, per group
    (`collective_check`): wraps whatever runs, so the no_sync programs are compared too."""
    if lowered.by_group is None:
        return fn
    check = collective_check.CollectiveCheck(
        lowered.by_group, comp.program, lowered.stage,
        report=functools.partial(comp.ctx.report.collective_check.__setitem__, lowered.stage))
    return collective_check.wrap(fn, check)


STAGE_WRAPPERS: list[Callable[[Callable, Lowered, "Compilation"], Callable]] = [
    with_no_sync_programs,   # first: the programs it derives lower like the plain one and run inside the check
    with_collective_check,   # around everything that runs
]
"""What wraps every lowered program, innermost first. The program cache is not in this list: it
wraps the stage compiler, storing the lowered program with what these wrappers read, and applies
this list again on a load."""


class Compilation:
    """One graph's pass through aot_autograd: the state its callbacks share (the pass context, the
    outlined bodies, the regions compiled so far, the compile-sharing handles)."""

    def __init__(self, ctx: PassContext, outlined: outline.Outlined, ac_regions: dict[int, str]):
        config = self.config = ctx.config
        self.ctx, self.outlined, self.ac_regions = ctx, outlined, ac_regions
        self.partitioned = False  # the post-partition passes ran when the joint graph was partitioned
        self.ahead: dict = {}     # the backward's regions, compiled with the forward's
        self.compiled: dict = {}  # regions this rank compiled, by (is_backward, key)
        self.share = compile_share.shared_compile(config.share_compile)
        # the local ranks split Inductor's ISA check before the first C++ kernel (the shortcut checks one)
        self.isa_share = (inductor_cpu.IsaShare(self.share) if config.lower == "inductor" and self.share is not None
                          and not config.fast_isa_check else None)
        # the program's name on every rank: the model (sharded in the same order everywhere), the code
        # dynamo compiled it from, and which compile of that code it is
        self.program = collective_check.Program(f"m{ctx.models[0].model_id}" if ctx.models else "graph",
                                                ctx.report.frame or f"graph {ctx.report.index}",
                                                ctx.report.frame_compile)
        cache_off = program_cache.supported(config) if config.program_cache else None
        self.use_cache = config.program_cache and cache_off is None
        if cache_off:
            ctx.report.notes.append(f"program cache: not used: {cache_off}")
            log.info("graphshard: program cache not used: %s", cache_off)
        self.added = program_cache.ReportDelta(ctx.report) if self.use_cache else None
        self.user_tag = _compat.cache_key_tag()  # the program's key tag is aot_autograd's only, not its regions'
        self.lower_variant = functools.partial(_lower_variant, config=config, share=self.share, compiled=self.compiled)

    # -- the driver -------------------------------------------------------------------------------

    def run(self, gm: fx.GraphModule, fake_inputs: list) -> Callable:
        """aot_autograd over ``gm`` with this compilation's callbacks, inside the program cache's
        settings when it is used."""
        config, ctx = self.config, self.ctx
        decomps = dict(decompositions())
        if config.lower == "inductor":
            decomps = {**_compat.inductor_decompositions(), **decomps}
        fw_compiler = functools.partial(self.compile_stage, "forward")
        bw_compiler = functools.partial(self.compile_stage, "backward")
        settings: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.use_cache:
            fw_compiler = _compat.serializable_compiler(program_cache.StageProgram, fw_compiler)
            bw_compiler = _compat.serializable_compiler(program_cache.StageProgram, bw_compiler)
            tag = program_cache.key_tag(gm, ctx, _process_rank())
            settings = _compat.program_cache_settings(f"{self.user_tag}/{tag}" if self.user_tag else tag,
                                                      program_cache.CACHEABLE_FUNCTIONS)
            outcome = program_cache.Outcome()
        with _no_dropped_gradients(), settings, program_cache.loading(self.rebuild):
            result = _compat.aot_module_simplified(gm, fake_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                                   partition_fn=self.partition, decompositions=decomps)
        if self.use_cache:
            note, hit = outcome.describe()
            ctx.report.notes.append(note)
            log.info("graphshard: graph %d: %s", ctx.report.index, note)
            if hit:
                ctx.report.compile_seconds["program_load"] = time.perf_counter() - outcome.start
        return result

    # -- stage: partition, then the post-partition passes -----------------------------------------

    def partition(self, joint: fx.GraphModule, joint_inputs, **kwargs):
        """Reads the joint graph; returns the forward and backward graphs, each through the
        post-partition passes. An outlined block's body (a joint with no inputs of its own) is
        partitioned once for all its calls (`recompute.partition_body`) and returned as it is."""
        config, ctx, outlined = self.config, self.ctx, self.outlined
        base = (_compat.inductor_partition_fn if config.lower == "inductor"
                else _compat.min_cut_rematerialization_partition)
        body = not joint_inputs and outlined.calls  # an outlined body's joint: aot_autograd partitions it first
        inputs = [n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")] if body else joint_inputs
        self._start_isa_checks(inputs)  # overlaps the partition
        if body:
            start = time.perf_counter()
            try:
                return recompute.partition_body(joint, base, kwargs, outlined)
            finally:
                outlined.partition_seconds += time.perf_counter() - start
        untagged = recompute.without_checkpointing(joint) if self.ac_regions else None  # before base: it edits the tags
        fw, bw = base(joint, joint_inputs, **kwargs)
        # lazy code generation: the passes recompile them, and regional lowering never runs them as code
        # (aot_autograd's lazy backward deep-copies the backward, which regenerates a plain module's code)
        fw, bw = (_compat.lazy_graph_module(outline.inline_calls(g, outlined)) for g in (fw, bw))
        if self.ac_regions:
            ctx.report.recompute = recompute.account(fw, bw, untagged, self.ac_regions, base, joint_inputs, kwargs,
                                                      ctx.report, outlined)
        fw, bw = self.post_partition(fw, "forward"), self.post_partition(bw, "backward")
        self.partitioned = True
        if (config.lower == "inductor" and config.regional and self.share is not None
                and whole_graph_reason(fw) is None and whole_graph_reason(bw) is None):
            self.ahead = plan_regions(bw, is_backward=True)[3]
        return fw, bw

    def post_partition(self, g: fx.GraphModule, stage: str) -> fx.GraphModule:
        """The post-partition passes on one partitioned graph (``stage``: forward or backward)."""
        self.ctx.stage = stage
        return run_passes(g, self.ctx, post_partition_passes())

    def _start_isa_checks(self, inputs) -> None:
        config = self.config
        if (config.lower == "inductor" and config.fast_isa_check
                and any(x.device.type == "cpu" for x in _tensors(inputs))):
            inductor_cpu.inductor_cpu_warmup()  # overlaps the partition (see the function)
        if self.isa_share is not None:
            self.isa_share.start(_tensors(inputs))  # overlaps the partition (`inductor_cpu.IsaShare`)

    # -- stage: lower ------------------------------------------------------------------------------

    def lower(self, stage: str, g: fx.GraphModule, inputs) -> Lowered:
        """Reads one partitioned graph (an inference graph aot_autograd did not partition gets the
        post-partition passes here); returns its lowered program and what the wrappers read."""
        ctx, config = self.ctx, self.config
        lowered = Lowered(stage, None)
        is_backward = stage == "backward"
        ctx.stage = stage
        if not self.partitioned:  # an inference graph: aot_autograd compiles it without partitioning
            g = self.post_partition(outline.inline_calls(g, self.outlined), stage)
        # read before lowering: Inductor rewrites the graph it compiles (in-place collectives)
        lowered.by_group = collective_check.fingerprint(g) if collective_check.enabled(config) else None
        if self.isa_share is not None and (checked_here := self.isa_share.seconds(_tensors(inputs))):
            ctx.report.notes.append(inductor_cpu.ISA_SPLIT_NOTE + inductor_cpu.describe_isa_checks(checked_here))
        if config.lower == "eager":
            lowered.program = _as_fx(g, inputs)
        elif config.regional and not _whole_graph(g, stage, ctx):
            lowered.program = self._lower_by_region(g, inputs, stage)
        else:
            if self.use_cache and is_backward and self.partitioned and _grad_sync_roots(g, ctx):
                # no_sync's source as partitioned: Inductor's lowering of a whole graph leaves it unpicklable
                lowered.kept_backward = _compat.graph_to_bytes(g, program_cache.BACKWARD_META)
            with _compat.inductor_config_patch(**INDUCTOR_SETTINGS, **_cpu_settings(inputs, config)):
                g = fuse_packed_gathers(g)
                dump_graph(ctx, "fuse_packed_gathers", g)
                lowered.program = compile_share.shared_whole_graph(
                    self.share, g, inputs, is_backward,
                    lambda: _whole_graph_compile(g, inputs, is_backward, config.batch_cpp_kernels))
            _record_lowered(lowered.program, stage, ctx)
        ctx.report.compile_seconds[f"{stage}_lowering"] = time.perf_counter() - lowered.start
        if is_backward and self.partitioned and (roots := _grad_sync_roots(g, ctx)):
            ctx.report.notes.append(f"no_sync: backward programs without the {len(roots)} data-parallel gradient "
                                    "reduction(s) and with the accumulated gradients added, each built and lowered "
                                    "on first use")
            lowered.no_sync = lambda: (g, roots, list(inputs))
            lowered.kept_backward = g if lowered.kept_backward is None else lowered.kept_backward
        return lowered

    def _lower_by_region(self, g: fx.GraphModule, inputs, stage: str) -> Callable:
        ctx, config = self.ctx, self.config
        with _compat.inductor_config_patch(**INDUCTOR_SETTINGS, **_cpu_settings(inputs, config),
                                           compile_threads=compile_share.compile_threads()):
            program, order, counts = lower_regions(
                g, is_backward=stage == "backward", share=self.share, ahead=self.ahead if stage == "forward" else None,
                compiled=self.compiled, batch=config.batch_cpp_kernels)
        ctx.report.lowered_order[stage] = order
        ctx.report.regions[stage] = counts
        if config.dump_graphs:
            with open(os.path.join(config.dump_graphs, f"g{ctx.report.index}_{stage}_regions.txt"), "w") as f:
                f.write(program.describe() + "\n")
        return program

    # -- the wrappers, and the program cache around them -------------------------------------------

    def wrap(self, lowered: Lowered) -> Callable:
        """``lowered``'s program inside `STAGE_WRAPPERS`, innermost first."""
        fn = lowered.program
        for wrapper in STAGE_WRAPPERS:
            fn = wrapper(fn, lowered, self)
        return fn

    def compile_stage(self, stage: str, g: fx.GraphModule, inputs):
        """aot_autograd's forward or backward compiler: `lower`, `wrap`, and with the program cache
        the result as a `program_cache.StageProgram` aot_autograd can store."""
        with _compat.with_cache_key_tag(self.user_tag):
            lowered = self.lower(stage, g, inputs)
            fn = self.wrap(lowered)
            if not self.use_cache:
                return fn
            return program_cache.StageProgram(
                stage, lowered.program, fn, by_group=lowered.by_group, backward=lowered.kept_backward,
                report=self.added.take(), seconds=time.perf_counter() - lowered.start,
                signature=program_cache.signature(inputs))

    def rebuild(self, stored: program_cache.StageProgram) -> None:
        """A program loaded from the cache: its report put back and `STAGE_WRAPPERS` applied again
        from what was stored with it; its first call checks its inputs (`program_cache.verified`)."""
        ctx = self.ctx
        program_cache.apply_delta(ctx.report, stored.report)
        lowered = Lowered(stored.stage, stored.lowered,
                          by_group=stored.by_group if collective_check.enabled(self.config) else None,
                          no_sync=(lambda: _stored_backward(stored, ctx)) if stored.backward is not None else None)
        stored.run = program_cache.verified(self.wrap(lowered), stored.signature, stored.stage, ctx.report.index)


_NO_DERIVATIVE = "autograd kernel was not registered"


@contextlib.contextmanager
def _no_dropped_gradients():
    """aot_autograd differentiates the ATen graph. An op there with no derivative of its own (a
    custom op whose gradient lives only in a C++ autograd wrapper the ATen trace went below, as
    fbgemm's ``permute_pooled_embs_auto_grad`` around ``permute_pooled_embs``) gets no gradient:
    torch's autograd fallback only warns, and the parameters behind it silently stop training.
    That warning is an error here, naming the op."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{_NO_DERIVATIVE}")
        try:
            yield
        except (UserWarning, RuntimeError) as e:
            if _NO_DERIVATIVE not in str(e):
                raise
            raise NotImplementedError(
                f"the compiled program differentiates an op with no derivative, so the tensors before it would get no "
                f"gradient: {str(e).split('. ')[0]}. graphshard traced below an autograd wrapper that holds the "
                "op's gradient; register the op's derivative (torch.library.register_autograd) or report it"
            ) from e


def _process_rank() -> tuple[int, int] | None:
    """(rank, world size) of this process's default group, if any."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _grad_sync_roots(bw: fx.GraphModule, ctx: PassContext) -> list[fx.Node]:
    """The backward's data-parallel gradient reductions ``graphshard.no_sync`` skips: with any, the
    backward runs as a `grad_sync.GradSync`, which selects a program without them."""
    if not ctx.models:
        return []
    mp_groups = {axis.group_name for axis in ctx.model_parallel.values()}
    params = {i for i, unit in enumerate(ctx.input_units) if unit is not None}
    return root_reductions(bw, mp_groups, params)


def _stored_backward(stored: program_cache.StageProgram, ctx: PassContext) -> tuple[fx.GraphModule, list, list]:
    """A loaded backward program's graph, for ``no_sync``'s programs: its roots found again."""
    bw = stored.backward_graph()
    inputs = [ph.meta["val"] for ph in bw.graph.find_nodes(op="placeholder")]
    return bw, _grad_sync_roots(bw, ctx), inputs


def _variant_dump(ctx: PassContext) -> Callable[[str, fx.GraphModule], None] | None:
    """With ``dump_graphs``: writes a ``no_sync`` program (`graphshard.passes.no_sync_programs`) when it is built."""
    folder = ctx.config.dump_graphs
    if not folder:
        return None

    def dump(name: str, g: fx.GraphModule) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"g{ctx.report.index}_backward_no_sync_{name}.txt"), "w") as f:
            f.write(g.print_readable(print_output=False, include_stride=False, include_device=False))

    return dump


def _lower_variant(g: fx.GraphModule, inputs: list, *, config, share, compiled: dict):
    """Lowers a backward program derived from the partitioned one (`grad_sync`): with its own
    facts, never aot_autograd's (which describe the graph it partitioned, not this one)."""
    if config.lower == "eager":
        return _as_fx(g, inputs)
    with _compat.inductor_config_patch(**INDUCTOR_SETTINGS, **_cpu_settings(inputs, config),
                                       compile_threads=compile_share.compile_threads()):
        if config.regional and whole_graph_reason(g) is None:
            return lower_regions(g, is_backward=True, share=share, compiled=compiled, batch=config.batch_cpp_kernels,
                                 report_strides=False)[0]
        with experimental.batched_cpp_kernels(enabled=config.batch_cpp_kernels):
            return _compat.inductor_compile_region(fuse_packed_gathers(g), inputs, is_backward=True)


def _as_fx(g: fx.GraphModule, inputs: list) -> Callable:
    """``lower="eager"``: the partitioned graph run as FX, its views relaxed to reshapes first
    (`relax_views`). aot_autograd traced it with each op's fake kernel, and some eager kernels return
    other strides (CPU BatchNorm over a transposed input returns a contiguous output where its fake
    kernel keeps the input's strides), so a ``view`` valid for the traced strides raises at run time;
    ``torch.compile(backend="aot_eager")`` raises on the same program. Inductor plans strides itself."""
    relax_views(g, None)
    g.recompile()
    return _compat.boxed_nop(g, inputs)


def _whole_graph_compile(g: fx.GraphModule, inputs, is_backward: bool, batch: bool):
    with experimental.batched_cpp_kernels(enabled=batch):  # its C++ kernels as one library (opt-in)
        return _compat.inductor_compile_inner(g, inputs, is_backward=is_backward)


def _cpu_settings(inputs, config) -> dict:
    """Inductor settings for a graph that computes on the CPU: with ``fast_isa_check``, the
    vector-ISA check done (``inductor_cpu.inductor_cpu_settings``); none by default."""
    if config.fast_isa_check and any(x.device.type == "cpu" for x in _tensors(inputs)):
        return inductor_cpu.inductor_cpu_settings()
    return {}


def _tensors(values) -> list[torch.Tensor]:
    """The tensors in ``values``, which may nest lists and tuples (the joint graph's inputs are
    ``(primals, tangents)``)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    return []


def _whole_graph(g: fx.GraphModule, stage: str, ctx: PassContext) -> bool:
    reason = whole_graph_reason(g)
    if reason:
        ctx.report.notes.append(f"{stage} graph lowered whole, not by region: {reason}")
    return reason is not None


def _record_lowered(compiled, stage: str, ctx: PassContext) -> None:
    """Puts the collective order of Inductor's generated code in the report (and the code in dumps)."""
    source = getattr(compiled, "source_code", None)
    if not source:
        return
    ctx.report.lowered_order[stage] = lowered_collective_order(source)
    if ctx.config.dump_graphs:
        with open(os.path.join(ctx.config.dump_graphs, f"g{ctx.report.index}_{stage}_inductor.py"), "w") as f:
            f.write(source)


_LOWERED_CALL = re.compile(r"^\s*(?:(?P<out>\w+) = )?torch\.ops\."
                           r"(?:_c10d_functional\.(?P<op>\w+)|graphshard\.pack_gather)\.default\((?P<arg>\w+)?")
"""A collective in Inductor's generated code: a functional collective, or the in-place gather
(`lowering.fuse_packed_gathers`), which starts an ``all_gather_into_tensor``."""
_LOWERED_ITEM = re.compile(r"^\s*(?P<out>\w+) = (?P<of>\w+)\[\d+\]\s*$")
_LOWERED_COMPUTE = re.compile(r"^\s*extern_kernels\.(mm|addmm|bmm|baddbmm)\(")


def lowered_collective_order(source: str) -> list[str]:
    """Collective starts, waits and matmuls in the order Inductor's generated ``call`` issues
    them; the waits on a coalesced collective's outputs count as one, as in the FX listing."""
    events: list[str] = []
    coalesced: set[str] = set()   # buffers a coalesced collective returns
    item_of: dict[str, str] = {}  # buffer picked out of one -> that collective's buffer
    waited: set[str] = set()
    body = source.split("def call(", 1)[-1]
    for line in body.splitlines():
        m = _LOWERED_CALL.match(line)
        if m:
            op = m["op"] or "all_gather_into_tensor"
            if op.endswith("_coalesced") and m["out"]:
                coalesced.add(m["out"])
            if op == "wait_tensor" and m["arg"] in item_of:
                if item_of[m["arg"]] in waited:
                    continue
                waited.add(item_of[m["arg"]])
            events.append(collective_kind(op))
        elif (item := _LOWERED_ITEM.match(line)) and item["of"] in coalesced:
            item_of[item["out"]] = item["of"]
        elif _LOWERED_COMPUTE.match(line):
            add_compute(events)
    return events
