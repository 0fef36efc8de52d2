"""A stub process ends without its interpreter's teardown once its instance is finalized, unless the
instance holds something only a destructor releases (``disagg.triton.entry.finalize_adapter``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, logging, sys
from disagg.triton.entry import finalize_adapter

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
atexit.register(lambda: print("teardown ran", flush=True))  # stands for the interpreter's teardown

class Adapter:
    teardown_at_exit = {keep}
    def finalize(self):
        logging.getLogger("x").info("finalized")
        sys.stdout.write("buffered, not flushed")

finalize_adapter(Adapter())
"""


@pytest.mark.parametrize("keep", [False, True])
def test_the_teardown_is_skipped_unless_the_instance_needs_it(keep: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(keep=keep)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "finalized" in done.stderr, "the log is flushed before the exit"
    assert "buffered, not flushed" in done.stdout
    assert ("teardown ran" in done.stdout) == keep
