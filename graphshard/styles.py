"""Tensor-parallel styles: the documented ``torch.distributed.tensor.parallel`` styles as plan specs.

A style says two things about the module it is applied to:

- how the module's own parameters are laid out over the tensor-parallel mesh
  axis (``param_placements``), and
- which layouts its inputs and outputs have (``io``): each becomes a
  ``graphshard::layout`` node in the traced program, a point where the compiler
  redistributes the activation to the declared placement.

graphshard's programs are logical (every value has the shape the user's code
gives it), so a declared layout never changes a value, only where its pieces
live. Declared layouts that agree with what propagation already computes cost
nothing; ``input_layouts`` that disagree are honoured by a redistribution, which
``explain`` lists with the module that caused it. ``use_local_output`` matters
only for the model's own outputs: the value the caller receives is the local
shard (True) or a DTensor (False).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.nn as nn
from torch.distributed.tensor import Placement, Replicate, Shard


def _check_placement(p: Any, what: str) -> Placement | None:
    if p is None or isinstance(p, (Shard, Replicate)):
        return p
    raise ValueError(f"{what}: {p!r} is not a layout; use Shard(dim), Replicate() or None")


def _as_tuple(x, what: str) -> tuple | None:
    if x is None:
        return None
    items = tuple(x) if isinstance(x, (list, tuple)) else (x,)
    return tuple(_check_placement(p, what) for p in items)


@dataclass(frozen=True)
class Layout:
    """The layouts one module input or output is declared to have: first ``given``, then ``desired``."""

    given: Placement | None
    desired: Placement | None

    def steps(self) -> tuple[Placement, ...]:
        out = tuple(p for p in (self.given, self.desired) if p is not None)
        return out[:1] if len(out) == 2 and out[0] == out[1] else out


@dataclass(frozen=True)
class ModuleIO:
    """Declared layouts of a module's positional inputs, keyword inputs and outputs."""

    inputs: tuple[Layout | None, ...] = ()
    kwarg_inputs: tuple[tuple[str, Layout], ...] = ()
    outputs: tuple[Layout | None, ...] = ()
    use_local_output: bool = True
    use_local_input: bool | None = None  # the inputs' own flag (PrepareModuleInputOutput); None: use_local_output

    def local(self, place: str) -> bool:
        """Whether the code after the declared layout at ``place`` (``in0``, ``in[name]``, ``out0``) gets
        plain local tensors (``use_local_output``) rather than DTensors."""
        if place.startswith("in") and self.use_local_input is not None:
            return self.use_local_input
        return self.use_local_output


class ParallelStyle:
    """Base of the tensor-parallel styles (the plan specs of a tensor-parallel mesh axis)."""

    def param_placements(self, fqn: str, module: nn.Module) -> dict[str, Placement]:
        return {}

    def io(self, fqn: str, module: nn.Module) -> ModuleIO | None:
        return None

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self), repr(self)))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


def _linear_or_embedding(style: ParallelStyle, fqn: str, module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    raise ValueError(
        f"{type(style).__name__} applies to nn.Linear and nn.Embedding, but {fqn or '<root>'!r} is "
        f"{type(module).__name__}; apply it to the Linear/Embedding submodules, or use PrepareModuleInput/Output "
        "for this module's activations"
    )


class ColwiseParallel(ParallelStyle):
    """Shards ``nn.Linear`` on its output features (weight and bias dim 0) and ``nn.Embedding``
    on its embedding dim (weight dim 1). Input replicated, output sharded on the last dim."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True):
        self.input_layouts = _check_placement(input_layouts, "ColwiseParallel input_layouts") or Replicate()
        self.output_layouts = _check_placement(output_layouts, "ColwiseParallel output_layouts") or Shard(-1)
        self.use_local_output = use_local_output

    def param_placements(self, fqn, module):
        if _linear_or_embedding(self, fqn, module) == "linear":
            return {"weight": Shard(0), "bias": Shard(0)} if module.bias is not None else {"weight": Shard(0)}
        return {"weight": Shard(1)}

    def io(self, fqn, module):
        return ModuleIO(inputs=(Layout(self.input_layouts, Replicate()),),
                        outputs=(Layout(None, self.output_layouts),), use_local_output=self.use_local_output)


class RowwiseParallel(ParallelStyle):
    """Shards ``nn.Linear`` on its input features (weight dim 1; the bias is replicated) and
    ``nn.Embedding`` on its rows (the vocabulary). Input declared ``Shard(-1)`` unless
    ``input_layouts`` says otherwise (as torch, for an embedding's ids too: pass
    ``input_layouts=Replicate()`` when every rank holds all the ids), redistributed to
    ``Shard(-1)`` (Linear) or replicated (Embedding); output replicated."""

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True):
        self.input_layouts = _check_placement(input_layouts, "RowwiseParallel input_layouts")
        self.output_layouts = _check_placement(output_layouts, "RowwiseParallel output_layouts") or Replicate()
        self.use_local_output = use_local_output

    def param_placements(self, fqn, module):
        if _linear_or_embedding(self, fqn, module) == "linear":
            return {"weight": Shard(1)}
        return {"weight": Shard(0)}

    def io(self, fqn, module):
        kind = _linear_or_embedding(self, fqn, module)
        desired = Shard(-1) if kind == "linear" else Replicate()
        given = self.input_layouts or Shard(-1)  # torch's default for both: the ids too are read as Shard(-1)
        return ModuleIO(inputs=(Layout(given, desired),), outputs=(Layout(None, self.output_layouts),),
                        use_local_output=self.use_local_output)


class SequenceParallel(ParallelStyle):
    """For LayerNorm, RMSNorm, Dropout and other modules that act on each position alone:
    parameters replicated, input and output sharded on ``sequence_dim``."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def io(self, fqn, module):
        seq = Shard(self.sequence_dim)  # torch: a plain tensor input is this rank's piece of the sequence
        return ModuleIO(inputs=(Layout(seq, seq),), outputs=(Layout(None, seq),),
                        use_local_output=self.use_local_output)


class PrepareModuleInput(ParallelStyle):
    """Declares the layouts of a module's inputs (``input_layouts``, one per positional input,
    None for non-tensors) and redistributes them to ``desired_input_layouts``."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts: Mapping[str, Placement] | None = None,
                 desired_input_kwarg_layouts: Mapping[str, Placement] | None = None,
                 use_local_output: bool = False):
        self.input_layouts = _as_tuple(input_layouts, "PrepareModuleInput input_layouts")
        self.desired_input_layouts = _as_tuple(desired_input_layouts, "PrepareModuleInput desired_input_layouts")
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None and len(self.input_layouts) != len(self.desired_input_layouts)
        ):
            raise ValueError(
                "PrepareModuleInput: input_layouts and desired_input_layouts must have the same length "
                f"(got {input_layouts!r} and {desired_input_layouts!r})"
            )
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        for k in self.desired_input_kwarg_layouts:
            if k not in self.input_kwarg_layouts:
                raise ValueError(f"PrepareModuleInput: desired_input_kwarg_layouts[{k!r}] has no input_kwarg_layouts entry")
        self.use_local_output = use_local_output

    def io(self, fqn, module):
        inputs = tuple(
            None if g is None else Layout(g, d)
            for g, d in zip(self.input_layouts or (), self.desired_input_layouts or ())
        )
        kw = tuple((k, Layout(g, self.desired_input_kwarg_layouts.get(k))) for k, g in self.input_kwarg_layouts.items())
        return ModuleIO(inputs=inputs, kwarg_inputs=kw, use_local_output=self.use_local_output)


class PrepareModuleOutput(ParallelStyle):
    """Declares the layouts of a module's outputs and redistributes them to ``desired_output_layouts``."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _as_tuple(output_layouts, "PrepareModuleOutput output_layouts")
        self.desired_output_layouts = _as_tuple(desired_output_layouts, "PrepareModuleOutput desired_output_layouts")
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(
                "PrepareModuleOutput: output_layouts and desired_output_layouts must have the same length "
                f"(got {output_layouts!r} and {desired_output_layouts!r})"
            )
        self.use_local_output = use_local_output

    def io(self, fqn, module):
        outs = tuple(None if g is None else Layout(g, d) for g, d in zip(self.output_layouts, self.desired_output_layouts))
        return ModuleIO(outputs=outs, use_local_output=self.use_local_output)


class PrepareModuleInputOutput(ParallelStyle):
    """`PrepareModuleInput` and `PrepareModuleOutput` on one module (torch's style of that name)."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts: Mapping[str, Placement] | None = None,
                 desired_input_kwarg_layouts: Mapping[str, Placement] | None = None,
                 use_local_input: bool = False, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def io(self, fqn, module):
        ins, outs = self.prepare_module_input.io(fqn, module), self.prepare_module_output.io(fqn, module)
        return ModuleIO(inputs=ins.inputs, kwarg_inputs=ins.kwarg_inputs, outputs=outs.outputs,
                        use_local_output=outs.use_local_output, use_local_input=ins.use_local_output)


def is_torch_style(style) -> bool:
    """Whether ``style`` is one of torch's own styles (defined in ``torch.distributed.tensor.parallel``)."""
    return type(style).__module__.startswith("torch.distributed.tensor.parallel")


def from_torch(style) -> ParallelStyle | None:
    """One of torch's own styles (``torch.distributed.tensor.parallel.ColwiseParallel`` ...) as
    graphshard's style of the same arguments, read from the attributes torch's constructor sets; None
    for anything else (a user's own subclass of torch's ``ParallelStyle`` is not torch's own)."""
    from torch.distributed.tensor import parallel as tp

    if not is_torch_style(style):
        return None
    kind = type(style)
    if kind is tp.ColwiseParallel:
        return ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                               use_local_output=style.use_local_output)
    if kind is tp.RowwiseParallel:
        return RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                               use_local_output=style.use_local_output)
    if kind is tp.SequenceParallel:
        (seq,) = style.sequence_sharding
        return SequenceParallel(sequence_dim=seq.dim, use_local_output=style.use_local_output)
    if kind is tp.PrepareModuleInput:
        return PrepareModuleInput(**_input_args(style), use_local_output=style.use_local_output)
    if kind is tp.PrepareModuleOutput:
        return PrepareModuleOutput(**_output_args(style), use_local_output=style.use_local_output)
    if kind is tp.PrepareModuleInputOutput:
        ins, outs = style.prepare_module_input, style.prepare_module_output
        return PrepareModuleInputOutput(**_input_args(ins), use_local_input=ins.use_local_output,
                                        **_output_args(outs), use_local_output=outs.use_local_output)
    return None


def _input_args(style) -> dict:
    return dict(input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts)


def _output_args(style) -> dict:
    return dict(output_layouts=style.output_layouts, desired_output_layouts=style.desired_output_layouts)


def placement_str(p: Placement) -> str:
    """The compact form the ``graphshard::layout`` op carries: ``R`` or ``S(<dim>)``."""
    return f"S({p.dim})" if isinstance(p, Shard) else "R"


def parse_placement(s: str, ndim: int) -> Placement:
    if s == "R":
        return Replicate()
    assert s.startswith("S(") and s.endswith(")"), s
    return Shard(int(s[2:-1]) % ndim)


def layout_steps(layouts: Sequence[Layout | None], i: int) -> tuple[Placement, ...]:
    return layouts[i].steps() if i < len(layouts) and layouts[i] is not None else ()
