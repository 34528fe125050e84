"""One call run in a process forked from the fork server (pipeir.runtime.forkserver), so that
the launcher need not import what the call needs: `pipeirc run`'s preflight traces the model
with torch, which the fork server has imported already and the launcher then never imports.

The call is named as `module:function`, so this process does not import it either. What
comes back: its value, or its PipeirError raised here as it was raised there (the same
message and exit code; a UserCodeError's traceback as text, for `--traceback`); and the files
it read as inputs (`pipeir.diagnostics.reading`), so that no output may overwrite them here
either. A KeyboardInterrupt there is one here; a child that dies (a signal, the kernel's
out-of-memory killer, a crash in a C extension) is a RunError naming `what` and how it died;
anything else it raised is a bug, not the user's error, and arrives as a RuntimeError carrying
the child's traceback.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from pipeir.diagnostics import PipeirError, add_inputs, read_inputs, reading
from pipeir.runtime.forkserver import context
from pipeir.runtime.launch import RunError, start_owned


def call(what: str, target: str, *args: Any, **kwargs: Any) -> Any:
    """`target(*args, **kwargs)` (`target` as `module:function`) in a forked process; `what`
    names it in messages ("the model check")."""
    ctx = context()
    recv, send = ctx.Pipe(duplex=False)
    procs, leash = start_owned(ctx, _serve, [(send, target, args, kwargs)])
    send.close()  # the child holds the only write end: its death is end-of-file here
    child = procs[0]
    try:
        try:
            kind, value, inputs = recv.recv()
        except EOFError:
            child.join()
            code = child.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else \
                f"exit code {code}"
            raise RunError(f"{what} died ({how}) before it finished") from None
        child.join()
    finally:
        if child.is_alive():  # interrupted here: the leash ends it
            child.kill()
            child.join()
        leash.close()
        recv.close()
    add_inputs(inputs)
    if kind == "interrupt":
        raise KeyboardInterrupt
    if kind == "error":
        raise value
    if kind == "crash":
        raise RuntimeError(f"{target} failed in its process:\n{value}")
    return value


def _serve(conn: Any, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The child: run the call and send (kind, value, inputs read) back."""
    module, _, name = target.partition(":")
    with reading():
        reply: tuple[str, Any]
        try:
            reply = ("ok", getattr(importlib.import_module(module), name)(*args, **kwargs))
        except PipeirError as e:
            reply = ("error", e)
        except KeyboardInterrupt:
            reply = ("interrupt", None)
        except BaseException:
            reply = ("crash", traceback.format_exc())
        inputs = read_inputs()
    conn.send((*reply, inputs))
    conn.close()
