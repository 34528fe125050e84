"""The model interface: what a user gives `pipeirc run --model`.

A model spec is a function (no arguments) returning a `ModelSpec`:

    import torch  # noqa: PLC0415 - torch loads only when a model is built
    from torch import nn
    from pipeir.models import ModelSpec

    def my_model() -> ModelSpec:
        def stage(s: int, stages: int) -> nn.Module:      # stage s of `stages`
            return nn.Sequential(nn.Linear(16, 16), nn.Tanh())

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(step)       # same data on every rank
            return torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)

        return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=batch)

Run it with `pipeirc run FILE --model my_file.py:my_model` (or `my_package.module:my_model`).

NOTE (why every rank can build its stages alone): stage s is built right after
`torch.manual_seed(seed + 1000 * s + 17)` (`build_stage`), so its initial weights do not
depend on which rank builds it nor on which other stages that rank owns; single-process
reference training builds the same weights. Every rank calls `batch(step)` and must get the
same batch (seed it by step), which is what lets pipeir split it into micro-batches and know
every shape without a handshake.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pipeir._importing import import_file
from pipeir.diagnostics import PipeirError, UsageError, did_you_mean
from pipeir.usercode import contained, import_module

if TYPE_CHECKING:
    import torch

#: Built-in model names -> "module:function".
BUILTINS: dict[str, str] = {
    "mlp": "pipeir.models.mlp:spec",
    "transformer": "pipeir.models.transformer:spec",
    "heavy-lm": "pipeir.models.heavy_lm:spec",
}


def _sgd(params: Iterable[Any]) -> Any:
    import torch  # noqa: PLC0415 - torch loads only when a model is built

    return torch.optim.SGD(list(params), lr=0.05)


#: `ModelSpec.autocast` values -> torch dtype names.
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}

#: A tied group: (stage, parameter name) pairs that are one weight.
TiedGroup = Sequence[tuple[int, str]]


@dataclass(frozen=True)
class ModelSpec:
    """A model split into pipeline stages, its loss, its data and how it trains.

    `stage(s, stages)` builds stage s as an nn.Module; it maps the previous stage's output to
    its own. An output may be a tensor or a (nested) tuple / list / dict of tensors and
    constants; the next stage is called with exactly that value. `loss(output, target)` is the
    mean loss of one micro-batch. `batch(step)` returns (inputs, targets), each a tensor or a
    dict of tensors whose first dimension is split into micro-batches (uneven splits are
    allowed), or a list of per-micro-batch values.

    Training: `optimizer(params)` (default SGD(lr=0.05)) is called once per stage with that
    stage's trainable parameters (elementwise optimizers such as SGD, Adam and AdamW then train
    exactly as one optimizer over the whole model); `scheduler(optimizer)` builds an LR
    scheduler stepped after every optimizer step; `clip_grad_norm` clips by the global norm
    over all stages; `autocast` is "bf16" or "fp16" (fp16 with dynamic loss scaling) for the
    stages' forwards and the loss; `tied(stages)` lists groups of (stage, parameter name)
    that are one weight (e.g. the embedding and the output head); `tokens(inputs)` counts the
    tokens of a batch's inputs for the tokens/s metric.
    """

    stage: Callable[[int, int], torch.nn.Module]
    loss: Callable[[Any, Any], torch.Tensor]
    batch: Callable[[int], tuple[Any, Any]]
    optimizer: Callable[[Iterable[Any]], Any] = _sgd
    seed: int = 0
    scheduler: Callable[[Any], Any] | None = None
    clip_grad_norm: float | None = None
    autocast: str | None = None
    tied: Callable[[int], Sequence[TiedGroup]] | None = None
    tokens: Callable[[Any], int] | None = None


def call_stage(module: torch.nn.Module, value: Any) -> Any:
    """Run a stage on its input as torch's `PipelineStage` does: a tuple (or list) is the
    stage's positional arguments, anything else (a tensor, a dict) its one argument. So the
    tuple a stage returns becomes the next stage's arguments, and one stage module serves
    pipeir and torch alike."""
    return module(*value) if isinstance(value, tuple | list) else module(value)


@runtime_checkable
class HasModelSpec(Protocol):
    """A model description that becomes a `ModelSpec` (`pipeir.models.ModuleSpec`)."""

    def model_spec(self) -> ModelSpec:
        ...

    def state_names(self) -> dict[str, list[str]]:
        """The unsplit module's state_dict names -> every name of the same tensor."""
        ...


def autocast_dtype(spec: ModelSpec) -> torch.dtype | None:
    """The autocast dtype of the spec, or None for full precision."""
    import torch  # noqa: PLC0415 - torch loads only when a model is built

    return None if spec.autocast is None else getattr(torch, AUTOCAST[spec.autocast])


def tied_groups(spec: ModelSpec, stages: int) -> list[list[tuple[int, str]]]:
    """The spec's tied groups for `stages` stages (groups of fewer than two are dropped)."""
    if spec.tied is None:
        return []
    try:
        groups = [[(int(s), str(n)) for s, n in g] for g in spec.tied(stages)]
    except Exception as e:  # None, a flat list, a triple ...: not groups of (stage, name)
        raise UsageError(f"tied({stages}) must give groups of (stage, parameter name) pairs: "
                         f"{type(e).__name__}: {e}") from None
    return [g for g in groups if len(g) > 1]


class StageBuildError(UsageError):
    """A stage's constructor raised `error`."""

    def __init__(self, stage: int, error: Exception):
        why = error.diagnostics[0].message if isinstance(error, PipeirError) else \
            f"{type(error).__name__}: {error}"  # (pipeir's own error: its message alone)
        super().__init__(f"building stage {stage} failed: {why}")
        self.error = error


def stage_modules(spec: ModelSpec, stages: int, which: Iterable[int]
                 ) -> dict[int, torch.nn.Module]:
    """Stages `which`, in whatever device or tensor mode is current; a stage that raises is
    a StageBuildError naming it."""
    built = {}
    for s in which:
        try:
            built[s] = spec.stage(s, stages)
        except Exception as e:
            raise StageBuildError(s, e) from None
    return built


def structure(spec: ModelSpec, stages: int, which: Iterable[int]) -> dict[int, torch.nn.Module]:
    """Stages `which`, for their parameter and buffer names and shapes only: on the meta
    device (no memory), or for real where a stage cannot be built there (one that moves
    itself: `.to("cpu")` cannot copy from meta)."""
    import torch  # noqa: PLC0415 - torch loads only when a model is built

    wanted = list(which)
    try:
        with torch.device("meta"):
            return stage_modules(spec, stages, wanted)
    except StageBuildError:
        return stage_modules(spec, stages, wanted)


def check_spec(spec: ModelSpec, stages: int) -> None:
    """Problems that need no data: fields of the wrong kind (a clip of 0 stopped training
    and a negative one reversed it, silently; a seed or an optimizer of the wrong kind failed
    only inside the ranks), unknown autocast, tied groups naming a missing stage or
    parameter or joining parameters of different shapes (UsageError naming them)."""
    for name in ("stage", "loss", "batch", "optimizer"):
        if not callable(getattr(spec, name)):
            raise UsageError(f"the model's {name} must be a function, got "
                             f"{getattr(spec, name)!r}" + (
                                 " (give the optimizer's class or a function of the "
                                 "parameters, e.g. torch.optim.SGD)" if name == "optimizer"
                                 else ""))
    for name in ("scheduler", "tied", "tokens"):
        if getattr(spec, name) is not None and not callable(getattr(spec, name)):
            raise UsageError(f"the model's {name} must be a function or None, got "
                             f"{getattr(spec, name)!r}")
    if type(spec.seed) is not int:
        raise UsageError(f"the model's seed must be an integer, got {spec.seed!r}")
    clip = spec.clip_grad_norm
    if clip is not None and (type(clip) not in (int, float) or not 0 < clip < math.inf):
        raise UsageError(f"clip_grad_norm must be a positive number (or None: no clipping), "
                         f"got {clip!r}")
    if spec.autocast is not None and spec.autocast not in AUTOCAST:
        raise UsageError(f"autocast '{spec.autocast}': expected one of "
                         f"{', '.join(AUTOCAST)} or None")
    groups = tied_groups(spec, stages)
    if not groups:
        return
    # a parameter in two places would be counted twice (in one group) or join two groups
    # that the runtime reduces separately: either way its gradient would be wrong
    seen: dict[tuple[int, str], int] = {}
    for i, g in enumerate(groups):
        for member in g:
            if member in seen:
                where = "twice in" if seen[member] == i else f"in tied group {seen[member]} and"
                raise UsageError(f"stage {member[0]} parameter '{member[1]}' is {where} tied "
                                 f"group {i}; list each parameter once (merge the groups)")
            seen[member] = i
    built = structure(spec, stages, sorted({s for g in groups for s, _ in g if 0 <= s < stages}))
    shapes = {s: {k: tuple(p.shape) for k, p in m.named_parameters()} for s, m in built.items()}
    for i, g in enumerate(groups):
        first = None
        for s, name in g:
            if not 0 <= s < stages:
                raise UsageError(f"tied group {i}: stage {s} does not exist (the model has "
                                 f"{stages} stages)")
            if name not in shapes[s]:
                raise UsageError(f"tied group {i}: stage {s} has no parameter '{name}'")
            if first is None:
                first = (s, name, shapes[s][name])
            elif shapes[s][name] != first[2]:
                raise UsageError(f"tied group {i}: stage {s} parameter '{name}' has shape "
                                 f"{list(shapes[s][name])}, stage {first[0]} parameter "
                                 f"'{first[1]}' {list(first[2])}")


def build_stage(spec: ModelSpec, s: int, stages: int) -> torch.nn.Module:
    """Stage s with its deterministic initial weights (see the module NOTE)."""
    import torch  # noqa: PLC0415 - torch loads only when a model is built

    torch.manual_seed(spec.seed + 1000 * s + 17)
    return spec.stage(s, stages)


def resolve(ref: str) -> ModelSpec:
    """`mlp`, `transformer`, `heavy-lm`, `package.module:function` or
    `path/to/file.py[:function]` (function defaults to `spec`) -> the ModelSpec it returns (a
    `ModuleSpec` is cut into one). Bad references are UsageErrors.
    (`pipeir.models.refs.resolve` adds `REF@POINT,...`.)"""
    spec = load(ref)
    if isinstance(spec, HasModelSpec):
        try:
            return spec.model_spec()
        except UsageError as e:
            raise UsageError(f"--model '{ref}': {e.message}") from None
    return spec


def load(ref: str) -> ModelSpec | HasModelSpec:
    """What `--model ref`'s function returns: a ModelSpec, or a description that becomes
    one (a `ModuleSpec`, which also knows the unsplit module's names for export)."""
    got = call_factory(ref, BUILTINS.get(ref, ref))
    if not isinstance(got, ModelSpec | HasModelSpec):
        raise UsageError(f"--model '{ref}': returned {type(got).__name__}, expected a "
                         "pipeir.models.ModelSpec or ModuleSpec")
    return got


def call_factory(ref: str, target: str) -> Any:
    """What the function `target` ("module:function", "file.py[:function]") returns."""
    where, sep, fn = target.rpartition(":")
    if not sep:
        where, fn = target, "spec"
    if where.endswith(".py") or "/" in where:
        module = _load_file(ref, Path(where))
    elif not where or not where.replace(".", "").replace("_", "").isalnum():
        raise UsageError(f"--model '{ref}': expected {', '.join(BUILTINS)}, module:function "
                         "or file.py[:function]")
    else:
        # a bare word is far more often a mistyped built-in than a module name
        module = import_module(where, f"--model '{ref}'",
                               did_you_mean(ref, BUILTINS) if "." not in where else ())
    factory = getattr(module, fn, None)
    if not callable(factory):
        raise UsageError(f"--model '{ref}': {where} has no function '{fn}'")
    with contained(f"--model '{ref}'", f"calling {fn}()"):
        return factory()


def _load_file(ref: str, path: Path) -> Any:
    return import_file(path, "pipeir_model", f"--model '{ref}'")
