"""Weights in: an unsplit state_dict (a mapping, a `.safetensors` or a `torch.save`d file)
copied into the stages that pipeir cut, by the unsplit module's names; and the walk over a
module's tensors that the copy, the meta build and the pruning share."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from pipeir.diagnostics import UsageError

#: What `ModuleSpec.weights` may be: a state_dict, or a `.safetensors` / `.pt` file.
Weights = Mapping[str, torch.Tensor] | str | os.PathLike[str]


def read_weights(source: Weights) -> Mapping[str, torch.Tensor]:
    """A state_dict from a mapping, a `.safetensors` file or a `torch.save`d `.pt` file."""
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    if not path.is_file():
        raise UsageError(f"weights '{path}': no such file")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file  # noqa: PLC0415 - optional extra (hf)
        except ImportError:
            raise UsageError(f"weights '{path}': reading .safetensors needs the safetensors "
                             "package (pip install 'pipeir[hf]')") from None
        loaded: dict[str, torch.Tensor] = load_file(str(path))
        return loaded
    try:
        got = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"weights '{path}': not a torch state_dict: {type(e).__name__}: "
                         f"{e}") from None
    if not isinstance(got, Mapping):
        raise UsageError(f"weights '{path}': holds a {type(got).__name__}, not a state_dict")
    return got


def load_into(stage: nn.Module, weights: Mapping[str, torch.Tensor], s: int) -> list[str]:
    """Copy stage `s`'s tensors from an unsplit state_dict (shapes must match); returns the
    names of its non-persistent buffers, which a state_dict never holds. A parameter or
    persistent buffer it lacks is a UsageError (it was once made up from a random build,
    silently), naming a prefix all of its names share (DDP's 'module.')."""
    missing = []
    with torch.no_grad():
        for name, t in tensors(stage):
            if name not in weights:
                missing.append(name)
                continue
            w = weights[name]
            if tuple(w.shape) != tuple(t.shape):
                raise UsageError(f"weights: '{name}' has shape {list(w.shape)}, the module "
                                 f"{list(t.shape)}")
            t.copy_(w)
    lacking = [n for n in missing if not _non_persistent(stage, n)]
    if lacking:
        near = next((k for k in weights if k.endswith("." + lacking[0])), None)
        prefix = near[:-len(lacking[0])] if near is not None else ""
        raise UsageError(
            f"weights: the file has no '{lacking[0]}'" +
            (f" (nor {len(lacking) - 1} more of stage {s}'s tensors)" if len(lacking) > 1
             else "") +
            (f"; it has '{near}': strip the prefix '{prefix}' from its names"
             if near is not None and all(k.startswith(prefix) for k in weights)
             else "; it must hold the unsplit module's state_dict"))
    return missing


def _non_persistent(module: nn.Module, name: str) -> bool:
    """Whether `name` is a buffer its module keeps out of its state_dict."""
    owner, _, leaf = name.rpartition(".")
    return leaf in module.get_submodule(owner)._non_persistent_buffers_set


def tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers (persistent or not), each shared one once."""
    return [*module.named_parameters(), *module.named_buffers()]


def set_tensor(module: nn.Module, name: str, value: torch.Tensor, like: torch.Tensor) -> None:
    """Put `value` where `name` is: a Parameter (trainable as `like`) or a buffer."""
    owner, _, leaf = name.rpartition(".")
    m = module.get_submodule(owner)
    if leaf in m._parameters:
        m._parameters[leaf] = nn.Parameter(value, requires_grad=like.requires_grad)
    else:
        m._buffers[leaf] = value


def all_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False)]
