"""What computing the global gradient norm at every step costs (the progress line's `grad norm`,
shown for every model, not only those that clip).

    python bench/grad_norm.py                       # mlp, 2 stages, 8 micro-batches
    python bench/grad_norm.py --model transformer --stages 2 --microbatches 4 --repeats 30

Per stage, in one process on one intra-op thread (as a rank runs): the median time of the
norm over the stage's gradients (`Optim._global_norm`, without its all-reduce) against the
median time of the stage's share of a step (forward and backward of every micro-batch), and
the ratio. The norm's other part is one all-reduce of a scalar among the pipeline ranks:
about one small-message round trip, `pipeirc profile`'s latency, printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pipeir.models.spec import build_stage, resolve
from pipeir.runtime.optim import Optim
from pipeir.runtime.profile import measure_link
from pipeir.runtime.worker import split_batch


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = resolve(args.model)
    modules = {s: build_stage(spec, s, args.stages) for s in range(args.stages)}
    xs, ys = split_batch(spec.batch(0), args.microbatches)

    def step_compute() -> None:
        for x, y in zip(xs, ys):
            h: Any = x
            for m in modules.values():
                h = m(h)
            (spec.loss(h, y) / len(xs)).backward()

    step_ms = _median_ms(step_compute, max(3, args.repeats // 4)) / args.stages
    print(f"{args.model}, {args.stages} stages, {args.microbatches} micro-batches "
          f"(medians of {args.repeats} runs; one stage's share of the step's compute)")
    print(f"{'stage':>5}  {'norm ms':>9}  {'step ms':>9}  {'norm / step':>11}")
    for s, m in modules.items():
        optim = Optim(spec, {s: m}, args.stages, list(range(args.stages)), s,
                      distributed=False)
        grads = optim._grads()
        norm_ms = _median_ms(lambda o=optim, g=grads: o._global_norm(g), args.repeats)
        print(f"{s:>5}  {norm_ms:9.3f}  {step_ms:9.1f}  {norm_ms / step_ms:11.3%}")
    latency, _ = measure_link()
    print(f"scalar all-reduce among 2 gloo ranks: about {2 * latency:.3f} ms (a round trip)")


if __name__ == "__main__":
    main()
