"""Secret, envelope, lease table and fault-injection details; the long-run leak check."""

from __future__ import annotations

import random
import stat

import pytest
import torch
from kv_support import small_layout
from kvpeer import fill

from disagg.kv import ChecksumMismatch, DescriptorError, SecretError, TransferError, TransportConfig
from disagg.kv.envelope import open_sealed, seal
from disagg.kv.errors import LeaseExpired, LeaseGone
from disagg.kv.fake import fake_regions
from disagg.kv.faulty import FaultConfig
from disagg.kv.lease import LeaseConfig, LeaseTable
from disagg.kv.secret import load_secret
from disagg.kv.stale import list_regions


def test_secret_created_once_with_mode_0600(tmp_path, monkeypatch):
    monkeypatch.delenv("DISAGG_SECRET", raising=False)
    path = tmp_path / "state" / "secret"
    first = load_secret(path)
    assert len(first) >= 32 and load_secret(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(SecretError) as info:
        load_secret(path)
    assert str(tmp_path) not in str(info.value)


def test_secret_from_environment_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_SECRET", "m" * 40)
    assert load_secret(tmp_path / "secret") == b"m" * 40 and not (tmp_path / "secret").exists()
    monkeypatch.setenv("DISAGG_SECRET", "short")
    with pytest.raises(SecretError):
        load_secret(tmp_path / "secret")


def test_envelope_purposes_do_not_mix():
    token = seal({"a": 1}, b"k" * 32, "one")
    assert open_sealed(token, b"k" * 32, "one", 4096) == {"a": 1}
    with pytest.raises(DescriptorError):
        open_sealed(token, b"k" * 32, "two", 4096)
    with pytest.raises(DescriptorError):
        open_sealed(token, b"k" * 32, "one", 10)


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown"):
        TransportConfig.from_dict({"ttl": 3}, b"k" * 32)
    with pytest.raises(ValueError):
        TransportConfig(secret=b"k" * 32, prefix="Bad/Prefix")
    with pytest.raises(ValueError):
        TransportConfig(secret=b"short")
    assert "secret" not in repr(TransportConfig(secret=b"k" * 32)).split("(", 1)[1].split("=")[0]
    assert "kkkk" not in repr(TransportConfig(secret=b"k" * 32))


def test_lease_release_once_and_expiry_by_clock():
    calls = []
    table = LeaseTable(
        LeaseConfig(ttl_s=10, max_leases=2), on_release_user=lambda lid, why: calls.append((lid, why))
    )
    table.grant("a" * 32, "r", (1, 2), now=100.0, nbytes=10)
    with pytest.raises(ValueError):  # a block is in one live lease at most
        table.grant("b" * 32, "r", (2,), now=100.0, nbytes=10)
    table.grant("c" * 32, "r", (3,), now=105.0, nbytes=10)
    with pytest.raises(RuntimeError):
        table.grant("d" * 32, "r", (4,), now=105.0, nbytes=10)
    assert table.expire(109.9) == [] and table.expire(110.0) == ["a" * 32]
    assert not table.release("a" * 32, "ack") and table.release("c" * 32, "ack")
    assert calls == [("a" * 32, "expired"), ("c" * 32, "ack")] and table.held() == 0


def test_failing_release_callback_does_not_block_others():
    table = LeaseTable(LeaseConfig(), on_release_user=lambda lid, why: 1 / 0)
    table.grant("a" * 32, "r", (1,), 0.0, 1)
    table.grant("b" * 32, "r", (2,), 0.0, 1)
    assert table.release_all() == 2 and table.held() == 0


def test_faults_partial_failure_corruption_delay(make):
    exp = make("shm")
    faulty = make("faulty")
    layout = small_layout(32)
    src = exp.allocate_memory(8, layout.block_bytes)
    dst = faulty.allocate_memory(8, layout.block_bytes)
    fill(src, 9)
    slept: list[float] = []
    faulty._hooks._sleep = slept.append

    token = exp.export_blocks(src, [0, 2, 4, 6], layout)
    faulty.set_faults(FaultConfig(fail_after_run=1))
    with pytest.raises(TransferError):
        faulty.import_blocks(token, dst, [0, 1, 2, 3])
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[2]) and not dst[2].any()  # partial (B3)

    faulty.set_faults(FaultConfig(corrupt=True, delay_s=0.25))
    with pytest.raises(ChecksumMismatch):  # B5
        faulty.import_blocks(token, dst, [0, 1, 2, 3])
    assert slept == [0.25]  # B6 delay injected through the hook, not by sleeping in the test
    s = faulty.stats.snapshot()
    assert (s.failures, s.checksum_failures) == (2, 1)

    faulty.set_faults(FaultConfig())
    faulty.import_blocks(token, dst, [0, 1, 2, 3])
    exp.poll()  # its native ack
    assert exp.held_leases() == 0 and exp.stats.snapshot().acks == 1


@pytest.mark.parametrize("kind", ["shm", "fake"])
def test_long_run_leaves_no_regions_or_leases(make, kind, prefix, clock):
    """Thousands of hand-offs with random aborts, dropped acks and expiries."""
    rng = random.Random(1234)
    fake_before = fake_regions()
    exp = make(kind, ttl_s=1.0, checksum=False, staging_blocks=16)
    imp = make(kind, checksum=False)
    layout = small_layout(24)  # 3 blocks
    src = exp.allocate_memory(64, layout.block_bytes)
    plain = torch.zeros(8, layout.block_bytes, dtype=torch.uint8)
    dst = imp.allocate_memory(64, layout.block_bytes)
    regions = len(list_regions("/dev/shm", prefix))
    outcomes = {"ok": 0, "abort": 0, "expire": 0, "late": 0, "dropped": 0}
    free = list(range(0, 63, 3))
    for i in range(3000):
        clock.advance(0.01)
        exp.poll()
        if not free:
            clock.advance(1.0)
            exp.poll()
            free = list(range(0, 63, 3))
            continue
        start = free.pop(rng.randrange(len(free))) if rng.random() < 0.9 else None
        pool, ids = (src, [start, start + 1, start + 2]) if start is not None else (plain, [0, 1, 2])
        try:
            token = exp.export_blocks(pool, ids, layout)
        except (ValueError, TransferError):
            if start is not None:
                free.append(start)
            continue
        lease = exp.lease_ids()[-1] if exp.lease_ids() else None
        roll = rng.random()
        if roll < 0.1 and lease:
            exp.abort(lease)
            outcomes["abort"] += 1
        elif roll < 0.15:
            outcomes["expire"] += 1  # never pulled: the lease must expire
        else:
            dropped = rng.random() >= 0.9  # the ack lost on its way: the lease expires instead
            imp.hooks.deliver_ack = lambda desc, dropped=dropped: not dropped
            try:
                imp.import_blocks(token, dst, [3 * (i % 21), 3 * (i % 21) + 1, 3 * (i % 21) + 2])
                outcomes["ok"] += 1
                outcomes["dropped"] += dropped
            except DescriptorError:
                outcomes["late"] += 1
        if start is not None:
            free.append(start)  # the engine would wait for on_release; tags guard the reuse
    clock.advance(2.0)
    exp.poll()
    assert exp.held_leases() == 0 and exp._staging.free_count() == 16
    # Reused, no growth: the two pools plus the staging region made once on the first plain export.
    assert len(list_regions("/dev/shm", prefix)) == regions + (kind == "shm")
    # a lost ack holds its blocks (and staging) until expiry, so fewer exports find room
    assert outcomes["ok"] > 1500 and outcomes["abort"] > 100 and outcomes["expire"] > 50, outcomes
    assert outcomes["dropped"] > 100
    # every lease never pulled, and every one whose ack was lost, ended by expiry
    assert exp.stats.snapshot().lease_expiries >= outcomes["expire"] + outcomes["dropped"]
    exp.close()
    imp.close()
    # Only this run's own prefix is counted: other processes on the host may create /dev/shm entries.
    assert list_regions("/dev/shm", prefix) == [] and fake_regions() == fake_before


def test_signals_name_their_purpose_and_refuse_forgeries():
    from disagg.kv.descriptor import ACK_PURPOSE, RENEW_PURPOSE, parse_signal, sign_ack, sign_renewal

    secret, lease, origin = b"s" * 32, "ab" * 16, "disagg.shm.1.cafe"
    assert parse_signal(sign_ack(lease, origin, secret), secret) == (ACK_PURPOSE, lease, origin)
    assert parse_signal(sign_renewal(lease, origin, 3, secret), secret) == (RENEW_PURPOSE, lease, origin)
    with pytest.raises(DescriptorError):  # another deployment's secret
        parse_signal(sign_renewal(lease, origin, 1, b"t" * 32), secret)
    with pytest.raises(DescriptorError):  # a renewal must count from 1
        parse_signal(sign_renewal(lease, origin, 0, secret), secret)
    with pytest.raises(DescriptorError):  # any other sealed body
        parse_signal(seal({"lease_id": lease}, secret, RENEW_PURPOSE), secret)


def test_a_lease_is_extended_only_forward_and_never_past_its_longest_life():
    table = LeaseTable(LeaseConfig(ttl_s=2.0))
    table.grant("a", "r", (0,), now=100.0, nbytes=8)
    assert not table.extend("a", 101.0, max_life_s=10.0)  # earlier than its expiry: unchanged
    assert table.extend("a", 105.0, max_life_s=10.0) and table.get("a").expires_at == 105.0
    assert table.extend("a", 200.0, max_life_s=10.0) and table.get("a").expires_at == 110.0
    assert not table.extend("a", 300.0, max_life_s=10.0)
    assert not table.extend("missing", 300.0, max_life_s=10.0)
    assert table.expire(109.9) == [] and table.expire(110.0) == ["a"]


def test_a_verified_descriptor_is_imported_without_a_second_verification(make, clock, monkeypatch):
    """The decode pool verifies a descriptor once, when the import is submitted; the import (and a
    renewal) given that ``Descriptor`` re-check only what time changes: its lease's expiry, and
    whether it was used. The signature and schema are not parsed again."""
    from disagg.kv import transport as transport_module

    exp, imp = make("shm", ttl_s=5.0), make("shm")
    layout = small_layout(32)
    src = exp.allocate_memory(8, layout.block_bytes)
    dst = imp.allocate_memory(8, layout.block_bytes)
    fill(src, 3)
    parsed: list[bytes] = []
    real = transport_module.parse_descriptor
    monkeypatch.setattr(
        transport_module,
        "parse_descriptor",
        lambda token, *a, **k: parsed.append(token) or real(token, *a, **k),
    )
    token = exp.export_blocks(src, [0, 1, 2, 3], layout)
    desc = imp.verify(token)
    imp.renew(desc)
    imp.import_blocks(desc, dst, [4, 5, 6, 7])
    assert parsed == [token], "parsed once, by verify"
    assert torch.equal(dst[4:8], src[0:4])
    with pytest.raises(LeaseGone):  # used: refused without parsing
        imp.import_blocks(desc, dst, [0, 1, 2, 3])
    late = imp.verify(exp.export_blocks(src, [4, 5], small_layout(16)))
    clock.advance(5.0 * 2 + 1)  # past its lease, and past the longest renewal
    with pytest.raises(LeaseExpired):
        imp.import_blocks(late, dst, [0, 1])
    assert len(parsed) == 2, "the expiry was found without parsing it again"
