"""Rule 3, *order* (the package NOTE): between each sender and receiver, sends and receives
are posted in the same order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from pipeir.backend.commcheck.findings import Finding, Key, Site, what
from pipeir.backend.commcheck.programs import Programs
from pipeir.backend.instructions import Comm


class Order(Programs):
    """Rule 3 over one set of programs."""

    def rule_order(self) -> Iterator[Finding]:
        sent, recvd = self.sides()
        for ch in sorted(set(sent) | set(recvd)):
            a, b = sent.get(ch), recvd.get(ch)
            if a is None or b is None:
                continue  # (nothing to cross: matching names what is missing)
            for k, (out, into) in enumerate(zip(a.posts, b.posts)):
                if out.mb == into.mb and out.stage == into.stage and out.tensor == into.tensor:
                    continue
                sx, ry = a[k], b[k]
                x, y = _key_of(sx), _key_of(ry)
                sy = next(s for s in a if _key_of(s) == y)
                rx = next(s for s in b if _key_of(s) == x)
                yield Finding(
                    f"receives {what(y)} from rank {ch[0]}, which sends {what(x)} first: the "
                    f"two transfers cross (rank {ch[0]} -> rank {ch[1]}: transfer #{k} is sent "
                    f"as {_key(x)} but received as {_key(y)}). Point-to-point messages "
                    f"between two ranks are matched in posting order (NCCL, and gloo with "
                    f"torch's tag 0), so each receive gets the other's tensor (async: wrong "
                    f"training or a shape error; blocking: a deadlock)", ry,
                    ((f"rank {ch[0]} sends {what(x)} first", sx),
                     (f"then {what(y)}", sy),
                     (f"rank {ch[1]} receives {what(x)} only later", rx)))
                break


def _key_of(site: Site) -> Key:
    return cast(Comm, site.ins).key


def _key(k: Key) -> str:
    return f"{k[0]} of stage {k[1]} mb {k[2]}"
