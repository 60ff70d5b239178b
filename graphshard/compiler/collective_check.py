"""Ranks compare a compiled program's collectives before it issues the first one.

A rank that issues another collective than its peers (another shape, another group, another
order) hangs the job with no word of where. graphshard knows every collective of a program
before it runs, so at a program's first run each rank posts, per process group, the
collectives it will issue there (op, dtype, sizes, arguments, in order) to the job's store, and
compares them with what the group's other ranks posted for the same program: the same model,
the same code dynamo compiled (a graph break's resume function is a code of its own), the same
compile of that code, and the same stage. A mismatch raises on every rank of the group, naming
the first collective that differs, each side's version and the FX node it came from (with the
user's source line where the node has a stack trace).

- No collective is used, and every wait on the store is bounded (by the process group's timeout,
  which is the store's): a peer that never reaches the program is an error that names it, not a
  hang.
- Sizes the data decides (a sparse all-to-all's splits, ids per batch) are posted as ``?`` and
  match anything; what is static is compared.
- A rank that recompiled alone (a guard that failed on its data only) compares its new graph
  with the peer's latest compile of the same code and stage, on what both have static, instead
  of waiting for a compile the peer will not do. Where those differ, the peer may be making the
  same recompile later: the rank then waits (bounded) for the peer's compile and compares with it.

A model with a model-parallel axis also compares, at every call, the shapes of the call's tensor
inputs over each model-parallel group (`agreeing_inputs`): the activations' collectives there are
as large as the inputs, and a rank fed another batch at a later step would otherwise reach them
unchecked (a symbolic-size program) or alone (a recompile its peer does not make).

On by default; ``CompileConfig(check_collectives=False)`` turns it off. ``explain`` prints what was
compared and what the first call spent on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.fx as fx

from graphshard import _compat
from graphshard.report import collective_kind

PREFIX = "graphshard/collectives"
DYNAMIC = "?"


@dataclass
class Entry:
    """One collective of a program, as its rank posts it (JSON: plain strings, numbers and lists)."""

    op: str      # all_gather, reduce_scatter, ... (explain's names)
    args: list   # each argument but the group: a tensor as "float32[4,8]", a list of sizes, a number or a
                 # string; "?" where the data decides
    node: str    # the FX node
    source: str  # the user's source line it came from, or that graphshard inserted it

    def describe(self) -> str:
        return f"{self.op}({', '.join(map(_show, self.args))}) from node {self.node!r}, {self.source}"

    def matches(self, other: "Entry", me: int, peer: int) -> bool:
        """Whether this rank's collective and the peer's are the same one (``me`` and ``peer``: the
        two ranks' positions in the group). An all-to-all's splits differ by rank, so they are
        checked pairwise: what this rank sends the peer is what the peer expects from it."""
        if self.op != other.op or len(self.args) != len(other.args):
            return False
        if self.op != "all_to_all":
            return all(_same(a, b) for a, b in zip(self.args, other.args))
        (x, out_a, in_a), (y, out_b, in_b) = self.args[:3], other.args[:3]
        if _dtype(x) != _dtype(y) or not all(_same(a, b) for a, b in zip(_dims(x)[1:], _dims(y)[1:])):
            return False
        if not out_a or not out_b:  # even splits: the same sizes everywhere
            return _same(x, y) and _same(out_a, out_b) and _same(in_a, in_b)
        return (max(me, peer) < min(len(out_a), len(in_a), len(out_b), len(in_b))
                and _same(in_a[peer], out_b[me]) and _same(out_a[peer], in_b[me]))


def _show(arg) -> str:
    return "[" + ", ".join(map(_show, arg)) + "]" if isinstance(arg, list) else str(arg)


def _same(a, b) -> bool:
    """Equal, a ``?`` on either side matching any one size or number."""
    if DYNAMIC in (a, b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str) and "[" in a and "[" in b:  # tensors: dtype, then each dim
        return _dtype(a) == _dtype(b) and _same(_dims(a), _dims(b))
    return a == b


def _dtype(tensor: str) -> str:
    return tensor.split("[", 1)[0]


def _dims(tensor: str) -> list:
    inner = tensor.split("[", 1)[1].rstrip("]") if "[" in tensor else ""
    return [d if d == DYNAMIC else int(d) for d in inner.split(",") if d]


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    ns = getattr(target, "namespace", None)
    return node.op == "call_function" and ns == "_c10d_functional" and "wait_tensor" not in str(target)


def _render(arg: Any):
    """An argument as posted: a tensor as ``dtype[d0,d1]``, a size the data decides as ``?``."""
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            dims = ",".join(str(d) if isinstance(d, int) else DYNAMIC for d in val.shape)
            return f"{str(val.dtype).removeprefix('torch.')}[{dims}]"
        return val if isinstance(val, int) else DYNAMIC  # a SymInt node: a size the data decides
    if isinstance(arg, (list, tuple)):
        return [_render(a) for a in arg]
    if isinstance(arg, torch.SymInt):
        return DYNAMIC
    return arg if isinstance(arg, (int, float, bool)) or arg is None else str(arg)


def _frame(node: fx.Node) -> str | None:
    """The last frame of the node's stack trace: ``file:line in fn: code``."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for i in range(len(trace) - 1, -1, -1):
        line = trace[i].strip()
        if line.startswith("File "):
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            try:
                path, lineno, fn = line.split(", ", 2)
                where = f"{path[len('File '):].strip(chr(34))}:{lineno.removeprefix('line ')} {fn}"
            except ValueError:
                where = line
            return f"{where}: {code}" if code else where
    return None


def _source(node: fx.Node, depth: int = 8) -> str:
    """The user's source line a collective came from: its own stack trace, else (a collective
    graphshard inserted) the nearest use of its result that has one, else the nearest producer of
    its input."""
    own = _frame(node)
    if own:
        return own
    for direction, word in (("users", "for"), ("all_input_nodes", "after")):
        seen, frontier = {node}, [node]
        for _ in range(depth):
            frontier = [m for n in frontier for m in getattr(n, direction) if m not in seen and not seen.add(m)]
            found = next((f for f in map(_frame, frontier) if f), None)
            if found:
                return f"inserted by graphshard {word} {found}"
    return "inserted by graphshard (no user source line near it)"


def fingerprint(gm: fx.GraphModule) -> dict[str, list[Entry]]:
    """Each process group's collectives in ``gm``, in the order the program issues them. Read from
    the graph before it is lowered: Inductor rewrites the graph it compiles (``all_reduce`` into
    ``all_reduce_``), and a rank that loads the other's compile from the cache does not."""
    by_group: dict[str, list[Entry]] = {}
    for n in gm.graph.nodes:
        if not _is_collective(n):
            continue
        *args, group = n.args
        by_group.setdefault(str(group), []).append(
            Entry(collective_kind(n.target._opname.rstrip("_")), [_render(a) for a in args], n.name, _source(n)))
    return by_group


class CollectiveMismatch(RuntimeError):
    """Ranks of a process group would issue different collectives: the job would hang in them."""


class Program(NamedTuple):
    """A compiled program's name, the same on every rank that compiles it.

    Not dynamo's frame ids or a count of the model's graphs: a frame only one rank compiles (a
    reference run on rank 0) shifts those, and a model with graph breaks has several graphs whose
    order of compilation is not the program's."""

    model: str  # ``m<id>``, this process's; on the store, its order among the group's models (`_model_on_group`)
    frame: str  # the code dynamo compiled it from (``Net.forward (model.py:12)``; a resume function is its own)
    compile: int  # which compile of that code, from 0 (a recompile is the next one)

    def __str__(self) -> str:
        return f"model {self.model}, {self.frame}, compile {self.compile}"


class CollectiveCheck:
    """The comparison a program makes at its first run (`wrap`)."""

    def __init__(self, by_group: dict[str, list[Entry]], program: Program, stage: str,
                 report: Callable[[str], None] | None = None) -> None:
        self.by_group = by_group  # `fingerprint` of the program's graph (stored with a cached program)
        self.program, self.stage, self.report = program, stage, report

    def run(self) -> None:
        t0 = time.perf_counter()
        self._waited = 0.0  # seconds in `_wait`: the peer still compiling, not the check's own cost
        store, rank = _compat.default_store(), dist.get_rank()
        compared = {}
        for group, entries in self.by_group.items():
            ranks = _compat.group_ranks(group)
            peers = [r for r in ranks if r != rank]
            if not peers:
                continue
            base = f"{PREFIX}/{group}/{_model_on_group(group, self.program.model)}/{self.program.frame}/{self.stage}"
            store.set(f"{base}/{self.program.compile}/{rank}", json.dumps([e.__dict__ for e in entries]))
            store.set(f"{base}/latest/{rank}", str(self.program.compile))
            for peer in peers:
                me, them = (rank, ranks.index(rank)), (peer, ranks.index(peer))
                theirs, exact = self._peer_entries(store, base, peer)
                try:
                    _compare(group, self.stage, me, entries, them, theirs, program=str(self.program))
                except CollectiveMismatch as differs:
                    if exact:
                        raise
                    # the peer's latest compile differs from this one: it may be compiling this one still (a
                    # recompile both ranks make, one later). Compare with that once it is posted; the
                    # difference stands if it never comes.
                    theirs = self._exact_entries(store, base, peer, differs)
                    _compare(group, self.stage, me, entries, them, theirs, program=str(self.program))
            compared[group] = (len(entries), len(peers))
        if self.report is not None and compared:
            dynamic = sum(DYNAMIC in json.dumps(e.args) for es in self.by_group.values() for e in es)
            groups = ", ".join(f"{g!r}: {n} collectives with {p} peer(s)" for g, (n, p) in compared.items())
            own = time.perf_counter() - t0 - self._waited
            self.report(f"{groups}; {dynamic} with data-dependent sizes (compared on their static part); "
                        f"{own * 1e3:.1f} ms on the first call, besides {self._waited * 1e3:.1f} ms waiting "
                        "for peers to reach the program")

    def _peer_entries(self, store, base: str, peer: int) -> tuple[list[Entry], bool]:
        """The peer's collectives for this compile of this code, or (the peer has not posted it) for
        its latest compile of the code; and whether they are this compile's."""
        key = f"{base}/{self.program.compile}/{peer}"
        if not store.check([key]):
            latest = f"{base}/latest/{peer}"
            self._wait(store, [latest], f"rank {peer} did not reach this {self.stage} program ({self.program})")
            if not store.check([key]):
                return _entries(store, f"{base}/{int(store.get(latest))}/{peer}"), False
        return _entries(store, key), True

    def _exact_entries(self, store, base: str, peer: int, differs: CollectiveMismatch) -> list[Entry]:
        key = f"{base}/{self.program.compile}/{peer}"
        self._wait(store, [key], f"rank {peer} did not compile this {self.stage} program ({self.program}), and its "
                   f"latest compile of the code differs:\n{differs}\n", cause=differs)
        return _entries(store, key)

    def _wait(self, store, keys: list[str], what: str, cause: Exception | None = None) -> None:
        timeout = store.timeout  # the job's own bound: the store's timeout is the process group's
        t0 = time.perf_counter()
        try:
            store.wait(keys, timeout)
        except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by store and version
            raise CollectiveMismatch(
                f"graphshard: {what} within {timeout.total_seconds():.0f} s; rank {dist.get_rank()} stops before its "
                "first collective. The peer is stuck elsewhere or runs other code (a rank-dependent branch, a "
                "recompile on this rank only). CompileConfig(check_collectives=False) turns this check off"
            ) from (cause or e)
        finally:
            self._waited += time.perf_counter() - t0


_MODELS_ON_GROUP: dict[str, list[str]] = {}


def _model_on_group(group: str, model: str) -> str:
    """The model's name on the group: which of the models that ran programs on this group it is, in
    the order they first did. Not the model's id: that counts every model this process sharded, and
    a rank that shards one more (a reference model on a one-rank mesh) shifts it."""
    seen = _MODELS_ON_GROUP.setdefault(group, [])
    if model not in seen:
        seen.append(model)
    return f"model{seen.index(model)}"


def _entries(store, key: str) -> list[Entry]:
    return [Entry(**e) for e in json.loads(store.get(key))]


def _compare(group: str, stage: str, me: tuple[int, int], mine: list[Entry], them: tuple[int, int],
             theirs: list[Entry], program: str = "") -> None:
    """Raises at the first collective that differs. ``me`` and ``them``: (global rank, position in the group)."""
    (rank, my_pos), (peer, peer_pos) = me, them
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a is not None and b is not None and a.matches(b, my_pos, peer_pos):
            continue
        lo, hi = sorted((rank, peer))
        sides = {rank: a, peer: b}
        lines = [f"  rank {r}: " + (sides[r].describe() if sides[r] is not None else "nothing (its program ends here)")
                 for r in (lo, hi)]
        raise CollectiveMismatch(
            f"graphshard: ranks {lo} and {hi} would issue different collectives on process group {group!r} in "
            f"this {stage} program{f' ({program})' if program else ''}; collective #{i} differs:\n" + "\n".join(lines) + "\n"
            "Every rank of a group must run the same program: look for a branch on the rank, a plan or model built "
            "differently on one rank, or inputs of another shape. Nothing was issued; the job would have hung in it."
        )


def agreeing_inputs(model, config) -> Callable[[Callable], Callable] | None:
    """A wrapper of a sharded model's compiled call under which, at every call, the ranks of each of its
    model-parallel groups compare the shapes and dtypes of the call's tensor inputs before any program
    runs; None where there is nothing to compare (no model-parallel axis, the check off, one rank).

    Why every call: on a model-parallel axis the activations' collectives are as large as the inputs,
    so a rank fed another batch at step 7 would issue collectives of other sizes. The first-run check
    cannot see it: a program whose sizes are symbolic runs unchanged on the new size, and a rank whose
    guard fails recompiles alone while its peer, with nothing new, is already inside the collective.
    Only a comparison every rank makes at every call ends on every rank; it is a store round trip per
    group and call (three requests: post, read, delete the last; `explain` prints its cost), made where the data
    is the collectives' size, not on data-parallel groups (each rank feeds its own batch there)."""
    if not enabled(config):
        return None
    groups = []
    for axis in model.plan.model_parallel_axes:
        group = model.axes[axis]
        if group.world > 1 and group.group_name not in {g for g, _ in groups}:
            groups.append((group.group_name, axis))
    if not groups:
        return None
    agreement = _InputAgreement(f"m{model.model_id}", groups)
    model.preamble.append(agreement)

    def wrap(call: Callable) -> Callable:
        def compiled_call(*args, **kwargs):
            agreement.check(args, kwargs)
            return call(*args, **kwargs)

        return compiled_call

    return wrap


class _InputAgreement:
    """`agreeing_inputs`' per-call comparison, and its cost for ``explain`` (a preamble line)."""

    def __init__(self, model: str, groups: list[tuple[str, str]]):
        self.model, self.groups = model, groups
        self.calls = 0
        self.seconds = 0.0  # the comparisons' own time
        self.waited = 0.0   # of which spent waiting for a peer to reach the call (its step takes that long anyway)
        self._where: list | None = None  # per group: its axis, this rank's key prefix, the peers' (first call)

    def _places(self) -> list:
        if self._where is None:
            rank = dist.get_rank()
            self._where = []
            for group, axis in self.groups:
                base = f"{PREFIX}/calls/{group}/{_model_on_group(group, self.model)}"
                peers = [r for r in _compat.group_ranks(group) if r != rank]
                self._where.append((group, axis, base, peers))
        return self._where

    def check(self, args, kwargs) -> None:
        t0 = time.perf_counter()
        n = self.calls
        self.calls += 1
        mine = _input_shapes((args, kwargs))
        store, rank = _compat.default_store(), dist.get_rank()
        for group, axis, base, peers in self._places():
            store.set(f"{base}/{n}/{rank}", mine)
            waiting = time.perf_counter()
            try:  # the store's get waits for the keys, bounded by its timeout (the process group's)
                theirs = store.multi_get([f"{base}/{n}/{peer}" for peer in peers])
            except Exception as e:  # noqa: BLE001 - the store's timeout error type varies by store and version
                raise CollectiveMismatch(
                    f"graphshard: a rank of the {axis!r} group did not reach call {n} of model {self.model} within "
                    f"{store.timeout.total_seconds():.0f} s (the process group's timeout); rank {rank} stops before "
                    "the call's first collective") from e
            finally:
                self.waited += time.perf_counter() - waiting
            for peer, value in zip(peers, theirs):
                value = value.decode()
                if value != mine:
                    lo, hi = sorted((rank, peer))
                    side = {rank: mine, peer: value}
                    raise CollectiveMismatch(
                        f"graphshard: ranks {lo} and {hi} of the model-parallel axis {axis!r} (process group "
                        f"{group!r}) called model {self.model} (call {n}) with inputs of other shapes:\n"
                        f"  rank {lo}: {side[lo]}\n  rank {hi}: {side[hi]}\n"
                        f"Ranks of a {axis!r} group compute one tensor together and must be fed the same shapes "
                        "(torch's tensor parallelism needs the same); the collectives would differ in size. Nothing "
                        "was issued.")
            if n:
                store.delete_key(f"{base}/{n - 1}/{rank}")  # every peer has read it: each posted call n after
        self.seconds += time.perf_counter() - t0

    def format(self) -> str:
        calls = max(self.calls, 1)
        groups = ", ".join(f"{axis!r}" for _, axis in self.groups)
        return (f"collective check: every call's input shapes compared over the model-parallel group(s) {groups}: "
                f"{self.calls} calls, {(self.seconds - self.waited) / calls * 1e3:.2f} ms a call, besides "
                f"{self.waited / calls * 1e3:.2f} ms a call waiting for peers to reach it")


def _input_shapes(value) -> str:
    """The tensors in a call's arguments, in order, as ``dtype[d0,d1]``; other values as their type."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}[{','.join(map(str, value.shape))}]"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_input_shapes(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_input_shapes(v)}" for k, v in value.items()) + "}"
    return type(value).__name__ if value is not None else "None"


def enabled(config) -> bool:
    """On a real process group of more than one rank (not the fake group of golden-graph tests)."""
    return (config.check_collectives and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1 and dist.get_backend() != "fake")


def wrap(fn: Callable, check: CollectiveCheck) -> Callable:
    """``fn`` (aot_autograd's boxed convention) with ``check`` run before its first call."""
    pending = [check] if check.by_group else []

    def run(args):
        if pending:
            with _compat.outside_fake_mode():
                pending[0].run()
            pending.clear()
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
