"""The argument scrubber: a child started with its environment parses its secret options as given, while
its /proc/PID/cmdline, which every local user reads, shows them masked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from disagg.launch import scrubber
from disagg.serverconfig import SECRET_OPTIONS

SECRET = "k3y-0f-the-adm1n"
CHILD = "import sys; print(repr(sys.argv[1:]), flush=True); sys.stdin.read()"


@pytest.fixture(autouse=True)
def kernel_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_KERNEL_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))
    scrubber.library.cache_clear()


def _child(args: list[str], env: dict[str, str]) -> tuple[str, bytes]:
    """Start a Python child with `args`; (the argv it parsed, its /proc/PID/cmdline as others read it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        parsed = child.stdout.readline().strip()  # main has run: the scrubber ran before it
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes()
    finally:
        child.communicate("", timeout=30)
    return parsed, cmdline


def test_the_child_parses_its_secret_while_its_command_line_hides_it() -> None:
    args = [f"{SECRET_OPTIONS[0]}apis:header={SECRET}", "--plain=visible", f"{SECRET_OPTIONS[1]}{SECRET}"]
    parsed, cmdline = _child(args, scrubber.environment({"PATH": "/usr/bin:/bin"}, SECRET_OPTIONS))
    assert parsed == repr(args)  # the program sees its options whole
    assert SECRET.encode() not in cmdline
    shown = cmdline.split(b"\0")
    assert f"{SECRET_OPTIONS[0]}".encode() + b"*" * len(f"apis:header={SECRET}") in shown
    assert b"--plain=visible" in shown  # nothing else is touched


def test_without_the_scrubber_the_secret_shows() -> None:
    """The property the scrubber keeps fails without it (the test above can fail)."""
    _, cmdline = _child([f"{SECRET_OPTIONS[0]}{SECRET}"], {"PATH": "/usr/bin:/bin"})
    assert SECRET.encode() in cmdline


def test_an_earlier_preload_is_kept_and_a_missing_compiler_is_an_error(monkeypatch) -> None:
    env = scrubber.environment({"LD_PRELOAD": "/opt/other.so"}, SECRET_OPTIONS)
    assert env["LD_PRELOAD"].split(":") == [str(scrubber.library()), "/opt/other.so"]
    monkeypatch.setenv("DISAGG_KERNEL_DIR", str(Path(env["LD_PRELOAD"].split(":")[0]).parent / "none"))
    monkeypatch.setenv("CC", "false")
    scrubber.library.cache_clear()
    with pytest.raises(scrubber.ScrubberError, match="admin key would show"):
        scrubber.environment({}, SECRET_OPTIONS)
    with pytest.raises(ValueError):
        scrubber.environment({}, ["bad\nprefix"])
