"""The pipeir schedule language grammar (`sched.lark`), shipped as package data."""

from importlib.resources import files


def grammar_text() -> str:
    """The Lark grammar of `.sched` files."""
    return files(__name__).joinpath("sched.lark").read_text(encoding="utf-8")
