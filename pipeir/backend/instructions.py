"""The instruction set of lowered programs: one frozen dataclass per instruction, their
mnemonics, and `Lowered`, the per-rank programs of one optimizer step.

This is the vocabulary every later layer speaks (the communication check, code generation,
the overlap pass, the runtime and interop), so it lives apart from the algorithm that produces
it (`pipeir.backend.lower`) and from its text and JSON forms (`pipeir.backend.program_io`):
reading a program needs neither the simulator nor the verifier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, TypeVar

Tensor = Literal["act", "grad"]
Part = Literal["input", "target"]

@dataclass(frozen=True, slots=True)
class Instr:
    """Base of every instruction. `op` and `at` name the schedule op and `.sched` line
    (`file:line`) it came from, so errors at run time can point back into the source."""

    op: str = field(default="", kw_only=True)
    at: str = field(default="", kw_only=True)
    #: Runs back to back with the instruction before it (inside an overlapped pair): passes
    #: must not place anything in between.
    paired: bool = field(default=False, kw_only=True)

    @property
    def mnemonic(self) -> str:
        return MNEMONICS[type(self)]

    def operands(self) -> str:
        """The instruction's own fields, as the text form prints them."""
        parts = []
        for f in fields(self):
            if f.name in ("op", "at", "paired"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = "[" + "; ".join(f"{v.mnemonic} {v.operands()}" for v in value) + "]"
            parts.append(f"{f.name}={value}")
        if self.paired:
            parts.append("paired")
        return " ".join(parts)

    def __str__(self) -> str:
        text = f"{self.mnemonic} {self.operands()}".rstrip()
        origin = " ".join(x for x in (self.op, self.at) if x)
        return f"{text:<44} # {origin}" if origin else text


@dataclass(frozen=True, slots=True)
class ZeroGrad(Instr):
    """Clear the gradients of this rank's stages (start of an optimizer step)."""


@dataclass(frozen=True, slots=True)
class OptimizerStep(Instr):
    """Apply the optimizer to this rank's stages (end of an optimizer step)."""


@dataclass(frozen=True, slots=True)
class Load(Instr):
    """Take micro-batch `mb`'s inputs (first stage) or targets (last stage) from the batch."""

    mb: int
    part: Part


@dataclass(frozen=True, slots=True)
class Forward(Instr):
    stage: int
    mb: int




@dataclass(frozen=True, slots=True)
class ForwardCheckpoint(Forward):
    """A forward that keeps only its input (and the RNG state), not its activations (FC).
    What it sends on is a Forward's output, so checks that follow tensors treat it as one."""


@dataclass(frozen=True, slots=True)
class Recompute(Instr):
    """Run a checkpointed forward again, with its RNG state, keeping the activations (RC)."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class Offload(Instr):
    """Start moving a forward's saved activations to host memory (OFF, on the copy stream)."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class Reload(Instr):
    """Start moving offloaded activations back; the backward waits for them (RELOAD)."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class Loss(Instr):
    """Loss of the last stage's output, times `scale` = 1/(m*accumulate) so the accumulated
    gradients equal those of one big batch."""

    stage: int
    mb: int
    scale: float


@dataclass(frozen=True, slots=True)
class Backward(Instr):
    """Full backward: input and weight gradients together; frees the activations."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class BackwardInput(Instr):
    """Input-gradient half (I): only what the previous stage waits for."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class BackwardWeight(Instr):
    """Weight-gradient half (W), after its I; frees the activations."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class ReduceGrad(Instr):
    """Start the all-reduce (mean) of `stage`'s gradients across the data-parallel replicas;
    asynchronous (torch's REDUCE_GRAD)."""

    stage: int


@dataclass(frozen=True, slots=True)
class WaitReduce(Instr):
    """Wait for `stage`'s gradient all-reduce (before the optimizer step)."""

    stage: int


@dataclass(frozen=True, slots=True)
class Handoff(Instr):
    """Local hand-off between consecutive stages on the same rank (V placement): the `act`
    of `stage` becomes the input of stage+1, or the `grad` of `stage`'s input becomes the
    output gradient of stage-1."""

    tensor: Tensor
    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class Comm(Instr):
    """A point-to-point transfer of `tensor` produced by `stage` for micro-batch `mb`.

    `act` flows from stage to stage+1, `grad` (the input gradient) from stage to stage-1."""

    tensor: Tensor
    stage: int
    mb: int
    peer: int
    tag: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.tensor, self.stage, self.mb)


@dataclass(frozen=True, slots=True)
class Send(Comm):
    """Blocking send."""


@dataclass(frozen=True, slots=True)
class Recv(Comm):
    """Blocking receive."""


@dataclass(frozen=True, slots=True)
class ISend(Comm):
    """Post a send (isend); a later `WaitSend` completes it."""


@dataclass(frozen=True, slots=True)
class IRecv(Comm):
    """Post a receive (irecv); a later `WaitRecv` completes it."""


@dataclass(frozen=True, slots=True)
class WaitSend(Comm):
    pass


@dataclass(frozen=True, slots=True)
class WaitRecv(Comm):
    pass


@dataclass(frozen=True, slots=True)
class WaitSends(Instr):
    """Wait for every send this rank has posted and not yet waited for.

    NOTE: a send's buffer is the producer's output, which nothing overwrites within a step,
    so nothing needs a send completed before the step ends: torch's runtime waits all its
    sends there, and so does `overlap`. One instruction for all of them, not a `wait-send`
    each, is a fifth fewer instructions for every later layer (the proof, the writer, the
    ranks' interpreter) to walk."""


@dataclass(frozen=True, slots=True)
class Batch(Instr):
    """Posts issued at the same point, as one `batch_isend_irecv`."""

    posts: tuple[Comm, ...]


MNEMONICS: dict[type, str] = {
    ZeroGrad: "zero-grad", OptimizerStep: "step", Load: "load", Forward: "forward",
    Loss: "loss", Backward: "backward", ForwardCheckpoint: "forward-checkpoint",
    Recompute: "recompute", Offload: "offload", Reload: "reload", BackwardInput: "backward-input",
    BackwardWeight: "backward-weight", Handoff: "handoff", Send: "send", Recv: "recv",
    ISend: "isend", IRecv: "irecv", WaitSend: "wait-send", WaitRecv: "wait-recv",
    Batch: "batch", ReduceGrad: "reduce-grad", WaitReduce: "wait-reduce",
    WaitSends: "wait-sends",
}
BY_MNEMONIC: dict[str, type] = {v: k for k, v in MNEMONICS.items()}


#: Per instruction class, a function taking every field by position, in `__init__`'s order
#: (its own, then `op`, `at` and `paired`): how the lowered-JSON reader builds one
#: (`_quick_init`).
BUILD: dict[type, Callable[..., Instr]] = {}


def _quick_init(cls: type) -> None:
    """Give `cls` an `__init__` that stores each field through its slot directly, and its
    positional builder (`BUILD`).

    NOTE: a frozen dataclass's own `__init__` stores each field with `object.__setattr__`
    (a global, an attribute and a generic call per field: 1 µs for a `send`), and lowering,
    the overlap pass and reading lowered.json build an instruction per row, millions at
    p = 64. The slot's descriptor stores the same value in half the time, and like
    `object.__setattr__` it is not the frozen class's refusing `__setattr__`, so instances are
    as immutable as before; equality, hashing, `fields` and `replace` are the dataclass's.
    Generated from `fields(cls)`, as dataclasses generates its own: the same parameters,
    defaults and keyword-only fields (tests/test_backend.py compares the signatures)."""
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    plain: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for f in fields(cls):
        if f.default_factory is not MISSING or hasattr(cls, "__post_init__"):
            raise TypeError(f"{cls.__name__}: _quick_init stores fields only")
        slot = getattr(cls, f.name)
        scope[f"set_{f.name}"] = slot.__set__
        param = f.name
        if f.default is not MISSING:
            scope[f"default_{f.name}"] = f.default
            param += f"=default_{f.name}"
        (keyword if f.kw_only else plain).append(param)
        body.append(f"    set_{f.name}(self, {f.name})")
    params = ", ".join(["self", *plain, *(["*", *keyword] if keyword else [])])
    names = ", ".join(p.partition("=")[0] for p in (*plain, *keyword))
    exec(f"def __init__({params}):\n" + ("\n".join(body) or "    pass") + "\n"
         f"def build({names}):\n    self = new(cls)\n" + "".join(b + "\n" for b in body) +
         "    return self", scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[misc]
    BUILD[cls] = scope["build"]


for _cls in MNEMONICS:
    _quick_init(_cls)

InstrT = TypeVar("InstrT", bound=Instr)


def builder(cls: type[InstrT]) -> Callable[..., InstrT]:
    """`cls`'s positional builder (`BUILD`: every field by position, `op`, `at` and `paired`
    last), for the loops that make an instruction per transfer: a keyword call per
    instruction was a tenth of lowering and of the overlap pass."""
    return BUILD[cls]  # type: ignore[return-value]

#: Instructions that do model compute (their time is "busy" in the measured bubble).
COMPUTE: tuple[type, ...] = (Forward, Loss, Backward, BackwardInput, BackwardWeight,
                             Recompute)


@dataclass(frozen=True)
class Lowered:
    """The lowered form of a schedule: per-rank programs for one optimizer step."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    accumulate: int
    placement: tuple[int, ...]
    programs: tuple[tuple[Instr, ...], ...]
    overlap: bool = False

    def program(self, rank: int) -> tuple[Instr, ...]:
        return self.programs[rank]

    def reduced_stages(self) -> set[int]:
        """The stages some `reduce-grad` all-reduces: every stage where the programs are for
        data parallelism (`commcheck` proves it), none where they are not."""
        return {i.stage for prog in self.programs for i in prog if isinstance(i, ReduceGrad)}

    def with_programs(self, programs: Sequence[Sequence[Instr]], overlap: bool) -> Lowered:
        return Lowered(self.name, self.ranks, self.stages, self.microbatches, self.accumulate,
                       self.placement, tuple(tuple(p) for p in programs), overlap)


def tag_of(tensor: Tensor, stage: int, mb: int, stages: int) -> int:
    """A tag unique per tensor within a step (gloo matches on it; NCCL ignores it)."""
    return (mb * stages + stage) * 2 + (1 if tensor == "grad" else 0)
