"""Bring your own `nn.Module`: `ModuleSpec` names an unsplit module, its data and loss, and
`pipeir.split` cuts it into the stages `pipeirc run` trains.

    from pipeir.models import ModuleSpec

    def spec() -> ModuleSpec:
        return ModuleSpec(module=lambda: MyModel(cfg), batch=batch, loss=loss,
                          points=["layers.2"], example=batch(0)[0][:4])

A stage begins at each point (a module name, torch's `SplitPoint.BEGINNING`, torchtitan's
split points); stages keep the module's parameter names. Two routes cut a module:

- trace (with `example`, one micro-batch input as torch's `mb_args`): torch's own tracer,
  `torch.distributed.pipelining.pipeline`, which follows any forward torch.export can capture
  (Hugging Face models among them). A traced stage takes the previous stage's outputs as
  positional arguments (torch's convention) and is specialised to the example's shapes:
  inputs of other shapes are refused (before launch, by the shape plan), naming the stage and
  both shapes.
- prune (without `example`): torchtitan's way, a deep copy of the module with the modules
  other stages own removed, which needs a forward that skips what is missing (an
  `nn.Sequential`, or `if self.norm is not None:` as torchtitan's models do).

NOTE (why one unsplit build per process): a stage's initial weights must equal the unsplit
model's, whatever rank builds it; building the whole module once under `seed` and copying the
stage out of it gives exactly those weights. With `weights` (an unsplit state_dict or a
`.safetensors` / `.pt` file) the module is split on the meta device and each stage takes only
its own tensors from the file; a stage whose tensors the file does not hold (a non-persistent
buffer such as a rotary table) is copied from a real build instead.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from pipeir.diagnostics import UsageError
from pipeir.models.spec import ModelSpec, TiedGroup, _sgd, call_stage
from pipeir.models.weights import (
    Weights,
    all_tensors,
    load_into,
    read_weights,
    set_tensor,
    tensors,
)

#: What `ModuleSpec.module` may be: the module, or a function building it (so pipeir can
#: build it on the meta device).
ModuleSource = nn.Module | Callable[[], nn.Module]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

#: A stage's {parameter name: the unsplit module's name of the weight} for parameters that
#: are copies of a weight another stage also holds: what `pipeir.torch_schedule` keeps tied
#: (`pipeir.runtime.wiring`).
TIED_ATTR = "_pipeir_tied"
#: A traced stage's (stage index, its inputs' shapes when traced; None: not recorded).
TRACED_ATTR = "_pipeir_traced_for"


@dataclass(frozen=True)
class ModuleSpec:
    """An unsplit `nn.Module` to train pipelined (`--model file.py:fn` takes it wherever it
    takes a `ModelSpec`). `module` is the module or a zero-argument builder; `batch(step)`
    and `loss(output, target)` are as in `ModelSpec`, with `output` the last stage's output;
    `points` are the names where stages begin (empty: the main layer list cut evenly for the
    schedule's stage count); `example` is one micro-batch input for torch's tracer (None: the
    prune route, see the module docstring); `weights` the initial unsplit weights. The
    training options are `ModelSpec`'s."""

    module: ModuleSource
    batch: Callable[[int], tuple[Any, Any]]
    loss: Callable[[Any, Any], torch.Tensor]
    points: Sequence[str] = ()
    example: Any = None
    weights: Weights | None = None
    optimizer: Callable[[Iterable[Any]], Any] = _sgd
    seed: int = 0
    scheduler: Callable[[Any], Any] | None = None
    clip_grad_norm: float | None = None
    autocast: str | None = None
    tokens: Callable[[Any], int] | None = None
    _cache: dict[Any, Any] = field(default_factory=dict, init=False, repr=False,
                                   compare=False)

    def split_points(self) -> list[str]:
        """The names where a stage may begin, in the order the forward calls them."""
        return list(self._units()[1:])

    def at(self, points: Sequence[str]) -> ModelSpec:
        """The module cut into `len(points) + 1` stages (see `Splittable.at`)."""
        if isinstance(points, str) or not isinstance(points, Sequence) or \
                not all(isinstance(p, str) for p in points):
            # (a string is a sequence of one-letter points: '13' cut at '1' and at '3')
            raise UsageError(f"split points are a list of module names, e.g. ['layers.2'], "
                             f"got {points!r}")
        points = list(points)
        candidates = self.split_points()
        at = [candidates.index(p) if p in candidates else -1 for p in points]
        for p, i in zip(points, at):
            if i < 0:
                raise UsageError(f"split point '{p}' is not a candidate; the candidates are "
                                 f"{', '.join(candidates)}")
        if at != sorted(set(at)):
            raise UsageError(f"split points {points} must be distinct and in model order "
                             f"({', '.join(candidates)})")
        return self._model_spec(lambda stages: points if len(points) + 1 == stages
                                else _wrong_count(points, stages))

    def model_spec(self) -> ModelSpec:
        """The `ModelSpec` `pipeirc run` trains: cut at `points`, or evenly over the main
        layer list for whatever stage count the schedule runs."""
        if self.points:
            return self.at(self.points)
        return self._model_spec(self.uniform)

    def uniform(self, stages: int) -> list[str]:
        """`stages - 1` points cutting the main layer list evenly (layer s * L // stages
        begins stage s), the modules before and after it going with the first and last."""
        units = self._units()
        layers = [i for i, u in enumerate(units) if u in self._layers()]
        if stages > len(layers):
            raise UsageError(f"the module's layer list has {len(layers)} layers, too few for "
                             f"{stages} stages")
        return [units[layers[s * len(layers) // stages]] for s in range(1, stages)]

    def state_names(self) -> dict[str, list[str]]:
        """Each state_dict name of the unsplit module -> every name of that tensor (a tied
        weight has several): what an exported checkpoint must hold to load with
        `strict=True`."""
        by_id: dict[int, list[str]] = {}
        for name, t in self._unsplit(real=False).state_dict(keep_vars=True).items():
            by_id.setdefault(id(t), []).append(name)
        return {n: names for names in by_id.values() for n in names}

    # ---- the split ------------------------------------------------------------------------
    def _model_spec(self, points_for: Callable[[int], list[str]]) -> ModelSpec:
        def stage(s: int, stages: int) -> nn.Module:
            points = tuple(points_for(stages))
            built = self._stage(points, s)
            setattr(built, TIED_ATTR, {n: group[0][1] for group in self._tied(points)
                                       for k, n in group if k == s})
            return built

        def tied(stages: int) -> list[TiedGroup]:
            return self._tied(tuple(points_for(stages)))

        return ModelSpec(stage=stage, loss=self.loss, batch=self.batch,
                         optimizer=self.optimizer, seed=self.seed, scheduler=self.scheduler,
                         clip_grad_norm=self.clip_grad_norm, autocast=self.autocast,
                         tied=tied, tokens=self.tokens)

    def _unsplit(self, real: bool) -> nn.Module:
        """The unsplit module: the given one, or built once under `seed` (on meta when not
        `real` and weights will fill it)."""
        if isinstance(self.module, nn.Module):
            return self.module
        key = ("unsplit", real or self.weights is None)
        if key not in self._cache:
            with _unfaked():
                torch.manual_seed(self.seed)
                device = "cpu" if key[1] else "meta"
                try:
                    with torch.device(device):
                        self._cache[key] = self.module()
                except Exception as e:
                    raise UsageError(f"building the module failed: {type(e).__name__}: "
                                     f"{e}") from None
        built: nn.Module = self._cache[key]
        return built

    def _layers(self) -> set[str]:
        root = self._unsplit(real=False)
        path = _main_container(root)
        return {f"{path}.{n}" if path else n for n, _ in
                root.get_submodule(path).named_children()}

    def _units(self) -> list[str]:
        """The modules a stage is made of, in the order the forward first calls them (the
        registration order where there is no example to run)."""
        if "units" not in self._cache:
            root = self._unsplit(real=False)
            units = _units_along(root, _main_container(root))
            if self.example is not None:
                try:
                    units = _call_order(root, units, _like(self.example, root))
                except UsageError:
                    if not self._on_meta(root):
                        raise
                    units = _call_order(self._unsplit(real=True), units, self.example)
            self._cache["units"] = units
        got: list[str] = self._cache["units"]
        return got

    def _on_meta(self, root: nn.Module) -> bool:
        """Whether `root` is the meta build; a forward that cannot run there (one that
        reads a value: `.item()`) marks the module to be split from a real build."""
        if self._cache.get("meta_fails") or not any(t.is_meta for _, t in tensors(root)):
            return False
        self._cache["meta_fails"] = True
        return True

    def _pieces(self, points: tuple[str, ...], real: bool) -> list[nn.Module]:
        units = self._units()
        real = real or self.weights is None or bool(self._cache.get("meta_fails"))
        key = ("pieces", points, real)
        if key not in self._cache:
            root = self._unsplit(real=real)
            with _unfaked():
                try:
                    self._cache[key] = (_trace(root, points, _like(self.example, root))
                                        if self.example is not None
                                        else _prune(root, units, points))
                except UsageError:
                    if not self._on_meta(root):
                        raise
                    return self._pieces(points, real=True)
        pieces: list[nn.Module] = self._cache[key]
        return pieces

    def _stage(self, points: tuple[str, ...], s: int) -> nn.Module:
        piece = self._pieces(points, real=False)[s]
        if hasattr(piece, TRACED_ATTR):  # a GraphModule's deep copy keeps no hooks
            traced = getattr(piece, TRACED_ATTR)
            built = self._copy(points, s)
            setattr(built, TRACED_ATTR, traced)
            built.register_forward_pre_hook(_same_shapes)
            return built
        return self._copy(points, s)

    def _copy(self, points: tuple[str, ...], s: int) -> nn.Module:
        """Stage s's module, a copy of the split's: empty in a meta or fake mode, its
        weights from `weights` or the unsplit build."""
        if _abstract():  # meta or fake: the structure only
            return _skeleton(self._pieces(points, real=False)[s])
        if self.weights is None:
            return _deepcopy(self._pieces(points, real=True)[s])
        stage = _skeleton(self._pieces(points, real=False)[s], torch.device("cpu"))
        missing = load_into(stage, self._weights(), s)
        if missing:  # not in the file (non-persistent buffers): from a real build
            real = dict(tensors(self._pieces(points, real=True)[s]))
            with torch.no_grad():
                for name in missing:
                    set_tensor(stage, name, real[name].detach().clone(), real[name])
        return stage

    def _weights(self) -> Mapping[str, torch.Tensor]:
        """The weights by every name of each tensor: a file holding a tied weight once (as
        Hugging Face's safetensors files do) gives it to every name."""
        if "weights" not in self._cache:
            assert self.weights is not None
            read = dict(read_weights(self.weights))
            for name, aliases in self.state_names().items():
                other = next((a for a in aliases if a in read and a != name), None)
                if other is None:
                    continue
                if name not in read:
                    read[name] = read[other]
                elif not torch.equal(read[name], read[other]):
                    raise UsageError(f"weights: '{name}' and '{other}' are one tied weight "
                                     "in the module but differ in the file")
            self._cache["weights"] = read
        got: Mapping[str, torch.Tensor] = self._cache["weights"]
        return got

    def _tied(self, points: tuple[str, ...]) -> list[TiedGroup]:
        """Groups of (stage, name) holding one `Parameter` of the unsplit module."""
        root = self._unsplit(real=False)
        aliases: dict[int, list[str]] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        pieces = self._pieces(points, real=False)
        names = [{n for n, _ in m.named_parameters()} for m in pieces]
        groups: list[TiedGroup] = []
        for alias in aliases.values():
            group = [(s, n) for s, have in enumerate(names) for n in alias if n in have]
            # one per stage: a stage holding two names of one Parameter holds it once
            one = list({s: (s, n) for s, n in reversed(group)}.values())
            if len(one) > 1:
                groups.append(sorted(one))
        return groups


def split(module: nn.Module, points: Sequence[str], example: Any = None) -> list[nn.Module]:
    """`module` cut into stages, stage k (k >= 1) beginning at `points[k - 1]`: traced by
    torch's `pipeline()` given an `example` micro-batch input, pruned from deep copies
    otherwise. The stages keep the module's parameter names and weights (copies)."""
    spec = ModuleSpec(module=module, batch=_no_batch, loss=_no_loss, example=example)
    ms = spec.at(points)
    return [ms.stage(s, len(points) + 1) for s in range(len(points) + 1)]


# ---- helpers -------------------------------------------------------------------------------

def _no_batch(step: int) -> tuple[Any, Any]:
    raise UsageError("pipeir.split builds stages only; it has no data")


def _no_loss(output: Any, target: Any) -> torch.Tensor:
    raise UsageError("pipeir.split builds stages only; it has no loss")


def _wrong_count(points: Sequence[str], stages: int) -> list[str]:
    raise UsageError(f"the split points {list(points)} make {len(points) + 1} stages; the "
                     f"schedule runs {stages}")


def _main_container(root: nn.Module) -> str:
    """The name of the module's main layer list: the Sequential / ModuleList / ModuleDict
    with the most children, the deepest of equals ('' for the root itself)."""
    best, most = "", -1
    for name, m in root.named_modules():
        if isinstance(m, _CONTAINERS) and len(m) >= most:  # ties: the deeper
            best, most = name, len(m)
    if most < 2:
        raise UsageError(f"{type(root).__name__} has no layer list (nn.Sequential, "
                         "nn.ModuleList or nn.ModuleDict of two or more) to split")
    return best


def _units_along(here: nn.Module, path: str, prefix: str = "") -> list[str]:
    """The layer list's children, and the siblings of every module on the way to it, in
    registration order."""
    if not path:
        return [prefix + n for n, _ in here.named_children()]
    first, _, rest = path.partition(".")
    out: list[str] = []
    for name, child in here.named_children():
        out += (_units_along(child, rest, prefix + name + ".") if name == first
                else [prefix + name])
    return out


def _call_order(root: nn.Module, units: list[str], example: Any) -> list[str]:
    """`units` in the order one forward on `example` (on meta, no memory) first calls them;
    units it never calls keep their place after the called ones."""
    order: list[str] = []
    hooks = [root.get_submodule(u).register_forward_pre_hook(
        lambda m, a, u=u: order.append(u) if u not in order else None) for u in units]
    try:
        with torch.no_grad():
            call_stage(root, example)
    except Exception as e:
        raise UsageError(f"the module cannot run the example: {type(e).__name__}: {e}") \
            from None
    finally:
        for h in hooks:
            h.remove()
    return order + [u for u in units if u not in order]


def _like(example: Any, root: nn.Module) -> Any:
    """The example on the module's device (meta for a module built there)."""
    device = next((t.device for _, t in tensors(root)), torch.device("cpu"))
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                           example)


def _trace(root: nn.Module, points: tuple[str, ...], example: Any) -> list[nn.Module]:
    """torch's tracer, each stage rewired to take the previous stage's outputs (`_chain`)."""
    args = tuple(example) if isinstance(example, tuple | list) else (example,)
    try:
        with _quiet_torch():
            pipe = pipeline(root, mb_args=args,
                            split_spec={p: SplitPoint.BEGINNING for p in points})
    except Exception as e:
        raise UsageError(f"torch's tracer cannot capture the module ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); leave `example` out "
                         "to split by pruning instead") from None
    if pipe.num_stages != len(points) + 1:
        raise UsageError(f"the trace has {pipe.num_stages} stages for {len(points)} split "
                         "points (is every point a module the forward calls?)")
    stages = [pipe.get_stage_module(s) for s in range(pipe.num_stages)]
    _chain(pipe.split_gm.graph, stages)
    for k, stage in enumerate(stages):
        assert isinstance(stage, fx.GraphModule)
        vals = [n.meta.get("val") for n in stage.graph.nodes if n.op == "placeholder"]
        setattr(stage, TRACED_ATTR, (k, tuple(tuple(v.shape) if isinstance(v, torch.Tensor)
                                              else None for v in vals)))
    persistent = set(root.state_dict())
    for stage in stages:
        _drop_unread(stage)
        for name, _ in stage.named_buffers():  # a rotary table stays out of state_dicts
            if name not in persistent:
                owner, _, leaf = name.rpartition(".")
                stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)
    return stages


def _same_shapes(stage: nn.Module, args: tuple[Any, ...]) -> None:
    """A traced stage's forward pre-hook: torch.export fixes every shape of the trace (views
    and reshapes to the example's sizes), so inputs of other shapes would fail deep in the
    graph or, where they broadcast, compute something else. Refuse them, naming both."""
    k, want = getattr(stage, TRACED_ATTR)
    got = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
    if len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got)):
        return
    raise UsageError(f"stage {k} was traced for inputs of shape ({_shapes(want)}) "
                     f"(ModuleSpec's example) but is given ({_shapes(got)}): a traced stage "
                     "keeps the example's shapes; give an example of one micro-batch as this "
                     "run cuts the batch")


def _shapes(shapes: Sequence[tuple[int, ...] | None]) -> str:
    return ", ".join("?" if t is None else "x".join(map(str, t)) or "scalar" for t in shapes)


def _drop_unread(stage: nn.Module) -> None:
    """Remove the tensors the stage's graphs never read. torch's split leaves some behind (a
    tied weight's other name, in the stage of its first use): unread, such a copy would
    never train, and a checkpoint would hold two values under one name."""
    read = _reads(stage)
    for name, _ in [*stage.state_dict(keep_vars=True).items()]:
        if name not in read:
            owner, _, leaf = name.rpartition(".")
            m = stage.get_submodule(owner)
            m._parameters.pop(leaf, None)
            m._buffers.pop(leaf, None)


def _reads(module: nn.Module, prefix: str = "") -> set[str]:
    """The names of the tensors a (graph) module reads; all of a module that has no graph."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return {prefix + n for n, _ in all_tensors(module)}
    out: set[str] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            out.add(prefix + str(node.target))
        elif node.op == "call_module":
            out |= _reads(module.get_submodule(str(node.target)),
                          prefix + str(node.target) + ".")
    return out


#: A value crossing a stage boundary: (the stage making it, its output index; -1: the
#: stage's one output) or (-1, the model input's index).
Value = tuple[int, int]


def _chain(top: fx.Graph, stages: list[nn.Module]) -> None:
    """Make every stage take exactly what the previous stage returns, as positional
    arguments. torch's split lets stage k read any earlier stage's output (a skip
    connection: stage 2 reading stage 0's mask); here such a value is carried along the
    chain, each stage in between taking it as an extra argument and returning it."""
    calls = [n for n in top.nodes if n.op == "call_module"]
    inputs = [n for n in top.nodes if n.op == "placeholder"]
    stage_of = {c: k for k, c in enumerate(calls)}

    def value(a: Any, k: int) -> Value:
        if isinstance(a, fx.Node):
            if a.op == "placeholder":
                return (-1, inputs.index(a))
            if a in stage_of:
                return (stage_of[a], -1)
            if a.op == "call_function" and a.target is operator.getitem \
                    and a.args[0] in stage_of:
                return (stage_of[a.args[0]], int(a.args[1]))  # type: ignore[arg-type]
        raise UsageError(f"stage {k} takes {a!r}, which no stage makes (a constant in the "
                         "trace); choose other split points")

    for c in calls:
        if c.kwargs:
            raise UsageError(f"torch's split passes {sorted(c.kwargs)} to {c.target} by "
                             "keyword; pipeir passes positional arguments only")
    n = len(calls)
    reads = [[value(a, k) for a in c.args] for k, c in enumerate(calls)]
    out = next(x for x in top.nodes if x.op == "output").args[0]
    outs = list(out) if isinstance(out, tuple | list) else [out]
    reads.append([value(a, n) for a in outs])
    cross = [[(-1, i) for i in range(len(inputs))]]
    for b in range(1, n + 1):
        need = list(dict.fromkeys(reads[b]))
        for later in reads[b + 1:]:
            need += [v for v in later if v[0] < b and v not in need]
        cross.append(need)
    for k, gm in enumerate(stages):
        assert isinstance(gm, fx.GraphModule)
        _rewire(gm, k, reads[k], cross[k], cross[k + 1])


def _rewire(gm: fx.GraphModule, k: int, reads: list[Value], takes: list[Value],
            gives: list[Value]) -> None:
    """Stage k's graph taking `takes` and returning `gives` (see `_chain`)."""
    graph = gm.graph
    holders = [x for x in graph.nodes if x.op == "placeholder"]
    node_of: dict[Value, fx.Node] = {}
    for v, ph in zip(reads, holders):
        if v in node_of:  # one value passed twice: one argument
            ph.replace_all_uses_with(node_of[v])
            graph.erase_node(ph)
        else:
            node_of[v] = ph
    for v in takes:
        if v not in node_of:
            with graph.inserting_before(next(iter(graph.nodes))):
                node_of[v] = graph.placeholder(f"carried_{v[0] + 1}_{v[1] + 1}")
    anchor = next(x for x in graph.nodes if x.op != "placeholder")
    for v in takes:  # the placeholders in argument order, before everything else
        anchor.prepend(node_of[v])
    out = next(x for x in graph.nodes if x.op == "output")
    made = out.args[0]
    values = [node_of[v] if v[0] < k else made if v[1] < 0 else made[v[1]]  # type: ignore[index]
              for v in gives]
    out.args = (values[0] if len(values) == 1 else tuple(values),)
    graph.lint()
    gm.recompile()


def _prune(root: nn.Module, units: list[str], points: tuple[str, ...]) -> list[nn.Module]:
    """torchtitan's split: stage k is a deep copy holding only its units."""
    starts = [0] + [units.index(p) for p in points] + [len(units)]
    out = []
    for k in range(len(points) + 1):
        mine = set(units[starts[k]:starts[k + 1]])
        stage = _deepcopy(root)
        for u in units:
            if u in mine:
                continue
            owner, _, leaf = u.rpartition(".")
            parent = stage.get_submodule(owner)
            if isinstance(parent, _CONTAINERS):
                del parent._modules[leaf]
            else:
                setattr(parent, leaf, None)
        out.append(stage)
    return out


def _skeleton(src: nn.Module, device: torch.device | None = None) -> nn.Module:
    """A copy of `src` whose tensors are new and empty, made in the current mode (meta, fake)
    or on `device`; tensors shared within `src` stay shared."""
    tensors = all_tensors(src)
    # the deep copy copies no data: each tensor is replaced below
    memo: dict[int, Any] = {id(t): None for _, t in tensors}
    with _unfaked():
        stage = _deepcopy(src, memo)
    made: dict[int, torch.Tensor] = {}
    for name, t in tensors:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        set_tensor(stage, name, made[id(t)], t)
    return stage


def _abstract() -> bool:
    """Whether stages are being built for their structure (meta device or a fake mode)."""
    if torch.get_default_device().type == "meta":
        return True
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def _unfaked() -> Any:
    """Build real tensors even inside a `FakeTensorMode` (the shape plan's)."""
    return unset_fake_temporarily()


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Copying a traced graph module reconstructs torch's own pytree specs, and torch warns
    about its own deprecated `LeafSpec` check there on every copy: noise for the user, who
    can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        yield


def _deepcopy(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    with _quiet_torch():
        return copy.deepcopy(module, memo)
