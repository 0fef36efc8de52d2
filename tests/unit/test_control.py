"""The model-control owner: one caller at a time across processes, and one restart per death."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disagg.control import ControlBusy, ModelControl, loadable_config, server_key

URL = "127.0.0.1:18000"


def test_the_server_key_is_the_same_with_or_without_the_scheme():
    assert server_key("http://127.0.0.1:18000/") == server_key(URL) == "127.0.0.1_18000"
    with pytest.raises(ValueError):
        server_key("http://")


def test_a_restart_made_since_the_pool_was_found_dead_is_not_made_again(tmp_path):
    first, second = ModelControl(URL, tmp_path), ModelControl(URL, tmp_path)  # two entry points' watchers
    calls: list[str] = []
    assert first.restart_once("decode", 100.0, lambda: calls.append("first") or True)
    assert not second.restart_once("decode", 100.0, lambda: calls.append("second") or True)
    assert calls == ["first"], "the second watcher saw the pool dead before the first one's restart"
    later = first.last_restart("decode")
    assert later is not None and later > 100.0
    assert second.restart_once("decode", later + 1.0, lambda: calls.append("again") or True)
    assert calls == ["first", "again"], "a death after the last restart is restarted"
    assert first.last_restart("prefill") is None


def test_a_restart_that_did_not_happen_is_not_recorded(tmp_path):
    control = ModelControl(URL, tmp_path)
    assert not control.restart_once("decode", 0.0, lambda: False)  # the model was being unloaded
    assert control.last_restart("decode") is None
    assert control.restart_once("decode", 0.0, lambda: True)


HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_another_process_holding_control_makes_callers_wait_and_its_death_frees_it(tmp_path):
    control = ModelControl(URL, tmp_path, timeout_s=0.3)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(control.lock_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ControlBusy), control.owner():
            pass
        holder.kill()  # a caller that dies holding it (kill -9): the kernel drops its lock
        holder.wait(10)
        with control.owner():
            control.record_restart("decode", 5.0)
        assert control.last_restart("decode") == 5.0
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdin.close()
        holder.stdout.close()


def test_a_live_config_loses_only_the_field_triton_fills_in_itself():
    live = {"name": "decode", "runtime": "model.py", "instance_group": [{"count": 2}]}
    assert loadable_config(live) == {"name": "decode", "instance_group": [{"count": 2}]}
    assert loadable_config({"runtime": "libtorch.so"}) == {"runtime": "libtorch.so"}
