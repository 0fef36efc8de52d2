"""disagg.procfs: the fields of /proc/<pid>/stat the project reads, the CPU time among them."""

from __future__ import annotations

import os
import time

from disagg.procfs import read_stat


def test_a_stat_line_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    fields = ["S", "1", "42"] + ["0"] * 8 + ["150", "25"] + ["0"] * 6 + ["777"]
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "stat").write_text(f"9 (a (b) c) {' '.join(fields)} 0 0\n")
    stat = read_stat(9, proc=tmp_path)
    assert stat is not None
    assert (stat.state, stat.ppid, stat.pgrp, stat.start_time, stat.cpu_ticks) == ("S", 1, 42, 777, 175)
    assert read_stat(10, proc=tmp_path) is None, "a process gone reads as None"


def test_cpu_ticks_grow_with_the_cpu_a_process_spends():
    before = read_stat(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # CPU time, not wall time: a busy loop of 0.2 CPU-seconds
        pass
    after = read_stat(os.getpid())
    assert before is not None and after is not None
    ticks = os.sysconf("SC_CLK_TCK")
    assert after.cpu_ticks - before.cpu_ticks >= 0.1 * ticks
