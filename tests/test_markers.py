"""The test markers (pyproject.toml, tests/conftest.py): the default run leaves the marked
suites out and an explicit -m brings them back, and a test that starts a process without
the `mp` marker fails, naming the marker, so the default run cannot silently grow.

Each case runs the project's own pytest settings and conftest on a small generated test
file, in a pytest subprocess (the guard is active in this very test, which is unmarked)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent
SETTINGS = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"][
    "ini_options"]

CASES = '''
import multiprocessing
import subprocess
import sys

import pytest


def test_plain():
    pass


@pytest.mark.mp
def test_marked_mp():
    p = multiprocessing.get_context("fork").Process(target=int)
    p.start()
    p.join()
    assert p.exitcode == 0


@pytest.mark.mp
@pytest.mark.smoke
def test_smoke():
    pass


@pytest.mark.solver
def test_solver():
    pass


@pytest.mark.abuse
def test_abuse():
    pass


@pytest.mark.slow
def test_slow():
    pass


def test_unmarked_process():
    multiprocessing.get_context("fork").Process(target=int).start()


def test_unmarked_torchrun():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "x.py"])


def test_unmarked_plain_subprocess():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
'''


def _ini(value: object) -> str:
    """A pyproject value as pytest.ini text: a list one item a line, a boolean in lower case."""
    if isinstance(value, list):
        return "\n    " + "\n    ".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A directory with the project's pytest settings, conftest and the cases above."""
    ini = "\n".join(f"{k} = {_ini(v)}" for k, v in SETTINGS.items()
                    if k not in ("testpaths", "timeout"))
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_cases=CASES)
    return pytester


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    """test name -> PASSED / FAILED, from -rA's short summary."""
    out = {}
    for line in result.outlines:
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED") and "::" in rest:
            out[rest.split("::")[1].split(" ")[0]] = word
    return out


def test_the_default_run_leaves_the_marked_suites_out(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-rA", "-p", "no:cacheprovider")
    assert _outcomes(result) == {
        "test_plain": "PASSED", "test_smoke": "PASSED",
        "test_unmarked_process": "FAILED", "test_unmarked_torchrun": "FAILED",
        "test_unmarked_plain_subprocess": "PASSED"}
    text = result.stdout.str()
    assert "test_unmarked_process starts a process: mark it @pytest.mark.mp" in text
    assert "test_unmarked_torchrun starts torchrun: mark it @pytest.mark.mp" in text


def test_an_explicit_m_selects_the_marked_suites(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-rA", "-p", "no:cacheprovider",
                                          "-m", "(mp and not smoke) or solver or abuse or slow")
    assert _outcomes(result) == {"test_marked_mp": "PASSED", "test_solver": "PASSED",
                                 "test_abuse": "PASSED", "test_slow": "PASSED"}


def test_an_unregistered_marker_is_an_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_typo="import pytest\n\n@pytest.mark.solvr\ndef test_x():\n"
                                 "    pass\n")
    result = project.runpytest_subprocess("-p", "no:cacheprovider", "test_typo.py")
    assert result.ret != 0
    assert "'solvr' not found in `markers` configuration option" in result.stdout.str() + \
        result.stderr.str()
