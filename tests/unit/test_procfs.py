"""disagg.procfs: the fields of /proc/<pid>/stat the project reads, the CPU time among them."""

from __future__ import annotations

import os
import time

from disagg.procfs import cmdline, read_stat, serves, stub_pids


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


def _process(proc, pid: int, ppid: int, argv: list[str], state: str = "S") -> None:
    fields = [state, str(ppid), "1"] + ["0"] * 16 + ["100"]
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} (x) {' '.join(fields)} 0 0\n")
    (proc / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))


def test_a_servers_stubs_of_a_model_are_its_live_children_named_for_that_model(tmp_path):
    stub = "/opt/tritonserver/backends/python/triton_python_backend_stub"
    _process(tmp_path, 100, 1, ["tritonserver"])
    _process(tmp_path, 101, 100, [stub, "/m/decode/1/model.py", "decode_0_0", "1"])
    _process(tmp_path, 102, 100, [stub, "/m/decode/1/model.py", "decode_0_1", "1"])
    _process(tmp_path, 103, 100, [stub, "/m/decode_hot/1/model.py", "decode_hot_0_0", "1"])
    _process(tmp_path, 104, 100, [stub, "/m/decode/1/model.py", "decode_1_0", "1"], state="Z")
    _process(tmp_path, 105, 200, [stub, "/m/decode/1/model.py", "decode_0_0", "1"])  # another server's
    _process(tmp_path, 106, 100, ["python", "decode_0_0"])  # not a stub
    (tmp_path / "self").mkdir()
    assert sorted(stub_pids(100, "decode", proc=tmp_path)) == [101, 102]
    assert stub_pids(100, "decode_hot", proc=tmp_path) == [103]
    assert stub_pids(100, "prefill", proc=tmp_path) == []
    assert cmdline(107, proc=tmp_path) is None
    hot = ["stub", "decode_hot_0_0"]
    assert serves(hot, "decode_hot") and not serves(hot, "decode"), "decode_hot is not an instance of decode"
