"""The runtime's hot path: autograd's engine entered directly (`pipeir.runtime.autograd`)
gives what torch's own front ends give, refuses what they refuse, and each step reports its
CPU time (`StepReport.cpu`)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import TIMEOUT, runtime_job

import pipeir
from pipeir.runtime import autograd
from pipeir.runtime.launch import launch


def _graph(seed: int) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    return x, lin, torch.tanh(lin(x))


@pytest.fixture(params=["engine", "public front ends"])
def entry(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways in: autograd's private engine entry, and the fallback through torch's public
    front ends for a torch without it."""
    if request.param == "public front ends":
        monkeypatch.setattr(autograd, "_engine_run_backward", autograd._public_run_backward)


@pytest.mark.usefixtures("entry")
def test_backward_equals_torch_backward() -> None:
    x1, l1, y1 = _graph(0)
    x2, l2, y2 = _graph(0)
    g = torch.randn(4, 2)
    torch.autograd.backward([y1], [g])
    autograd.backward([y2], [g])
    for a, b in ((x1.grad, x2.grad), (l1.weight.grad, l2.weight.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.usefixtures("entry")
def test_backward_of_a_scalar_loss_starts_from_one() -> None:
    _, l1, y1 = _graph(1)
    _, l2, y2 = _graph(1)
    y1.square().mean().backward()
    autograd.backward([y2.square().mean()], None)
    torch.testing.assert_close(l1.bias.grad, l2.bias.grad, rtol=0, atol=0)


@pytest.mark.usefixtures("entry")
def test_grad_equals_torch_grad_and_leaves_dot_grad_alone() -> None:
    x, lin, y = _graph(2)
    g = torch.randn(4, 2)
    want = torch.autograd.grad([y], [x, lin.weight], [g], retain_graph=True)
    got = autograd.grad([y], [x, lin.weight], [g])
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert x.grad is None and lin.weight.grad is None


@pytest.mark.usefixtures("entry")
def test_grad_from_edges_equals_torch_grad_restarted_at_the_node() -> None:
    _, lin, y = _graph(4)
    g = torch.randn(4, 2)
    want = torch.autograd.grad([y], [lin.weight, lin.bias], [g], retain_graph=True)
    got = autograd.grad_from_edges([torch.autograd.graph.get_gradient_edge(y)],
                                   [lin.weight, lin.bias], [g])
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_gradient_of_the_wrong_shape_is_refused() -> None:
    _, _, y = _graph(3)
    with pytest.raises(RuntimeError, match=r"Mismatch in shape: grad_output\[0\]"):
        autograd.backward([y], [torch.ones(5, 2)])
    with pytest.raises(RuntimeError, match="1 gradients for 2 outputs"):
        autograd.grad([y, y], [y], [torch.ones(4, 2)])


@pytest.mark.mp
def test_every_step_reports_its_cpu_time() -> None:
    job = runtime_job(pipeir.library.get("1f1b", 2, 4), None, 3)
    res = launch([job], 2, timeout_s=TIMEOUT)
    for s in range(3):
        rep = res.steps[(0, s)]
        # two processes' CPU time, each more than nothing and (one step) not minutes
        assert 0 < rep.cpu < 60, rep
