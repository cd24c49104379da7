"""The disk tier of the prefix cache (scheduler/disk_tier.py): KV that outlives the scheduler and is shared
through a directory. Every path that serves KV from disk gives exactly the tokens and logprobs of a cold run
(both model families and the CPU serving default, W8A8 + int8 KV); damaged, truncated and foreign files are
deleted and recomputed, never served; the byte budget evicts the least recently used files; two processes
writing the same entries and a reader racing them stay consistent; a full disk loses entries, not requests."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from core.engine import SlotSnapshot
from scheduler import disk_tier
from scheduler.disk_tier import BLOCK, SUFFIX, DiskTier, chain_next, chain_start
from scheduler_helpers import cache_path_engine, cold_logprobs, ids, make, request, run_all, token_logprobs

ROOT = Path(__file__).resolve().parents[1]
SLOTS = 4
SYSTEM = ids(1, BLOCK + 9)  # a full block and a tail


@pytest.fixture(scope="module", params=["gemma3", "gemma4", "gemma3-w8a8-int8kv"])
def engine(request, compile_cache):
    return cache_path_engine(request.param, SLOTS)


def restarted(engine, tokenizer, directory: Path, **config):
    """A new scheduler on the same engine: it knows nothing of what the device slots hold, as after a
    restart; only the directory carries KV over."""
    return make(engine, tokenizer, disk_tier_dir=str(directory), **config)


def run_logprobs(sched, req):
    handle = sched.submit(req)
    sched.run_until_idle()
    return token_logprobs(handle)


def test_a_restarted_scheduler_continues_a_conversation_from_disk(engine, tokenizer, tmp_path):
    first = request(SYSTEM + ids(2, 20), max_tokens=8, affinity="s")
    before = restarted(engine, tokenizer, tmp_path)
    out1 = run_all(before, [first])[0][0]
    assert before.disk.flush(10) and before.disk.stats()["writes"] >= 3  # a block, the prompt's tail, the end's
    second = request(first.prompt_ids + tuple(out1) + ids(3, 7), max_tokens=8, affinity="s")

    after = restarted(engine, tokenizer, tmp_path)
    pairs, fin = run_logprobs(after, second)
    held = len(first.prompt_ids) + len(out1) - 1  # the last sampled token's KV was never computed
    assert after.kv.stats.disk_restores == 1 and fin.usage.cached_tokens == held
    assert after.stats.prefill_tokens == len(second.prompt_ids) - held
    assert pairs == cold_logprobs(engine, tokenizer, second)


def test_a_stop_writes_what_slots_and_the_host_tier_hold(engine, tokenizer, tmp_path):
    """A conversation pushed out to the host tier and one still in a slot are both on disk after stop()."""
    sched = restarted(engine, tokenizer, tmp_path, disk_tier_flush_s=30.0)
    sched.disk.store_missing = lambda *a, **k: 0  # nothing reaches the disk before the stop ...
    evicted = request(SYSTEM + ids(4, 30), affinity="a")
    said = run_all(sched, [evicted])[0][0]
    others = [request(ids(100 + i, BLOCK + 3), affinity=f"o{i}", cache_scope="other") for i in range(SLOTS)]
    said_by_other = run_all(sched, others)[1][0]
    assert sched.kv.stats.host_saves >= 1
    del sched.disk.store_missing  # ... but the stop writes everything
    sched.start()
    sched.stop()
    assert not any(tmp_path.glob(".*.tmp"))
    after = restarted(engine, tokenizer, tmp_path)
    for first, out in ((evicted, said), (others[1], said_by_other)):  # from the host tier, from a slot
        later = request(first.prompt_ids + tuple(out) + ids(5, 4), cache_scope=first.cache_scope)
        pairs, fin = run_logprobs(after, later)
        assert fin.usage.cached_tokens == len(first.prompt_ids) + len(out) - 1
        assert pairs == cold_logprobs(engine, tokenizer, later)
    assert after.kv.stats.disk_restores == 2


def test_a_failure_to_keep_kv_on_disk_loses_files_not_requests(engine, tokenizer, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no copy off the device today")

    sched = restarted(engine, tokenizer, tmp_path)
    monkeypatch.setattr(engine, "save_slot", broken)
    req = request(SYSTEM + ids(9, 4))
    pairs, fin = run_logprobs(sched, req)
    assert pairs == cold_logprobs(engine, tokenizer, req) and sched.failure is None
    assert not list(tmp_path.glob(f"*{SUFFIX}"))
    monkeypatch.undo()
    assert run_logprobs(sched, req)[1].usage.cached_tokens == len(req.prompt_ids) - 1  # the slot still serves


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_truncated_or_foreign_files_are_deleted_and_recomputed(engine, tokenizer, tmp_path, damage):
    req = request(SYSTEM + ids(7, 5))
    sched = restarted(engine, tokenizer, tmp_path)
    run_all(sched, [req])
    sched.disk.flush(10)
    victim = tail_of(tmp_path, engine.kv_identity(), req.prompt_ids)  # the first block still serves
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:  # a whole, valid file of another engine identity under this entry's name
        foreign = DiskTier(tmp_path / "foreign", 2**30, "another-model")
        foreign.store(None, req.prompt_ids, snapshot(req.prompt_ids))
        foreign.flush(10)
        victim.write_bytes(tail_of(tmp_path / "foreign", "another-model", req.prompt_ids).read_bytes())
    again = request(req.prompt_ids + ids(8, 3))
    after = restarted(engine, tokenizer, tmp_path)
    pairs, fin = run_logprobs(after, again)
    assert after.disk.stats()["damaged"] == 1
    assert fin.usage.cached_tokens == 0  # nothing restored past a bad file: the whole prompt recomputed
    assert pairs == cold_logprobs(engine, tokenizer, again)
    assert after.disk.flush(10) and not victim.exists()
    # the recomputed prompt's own files, whole: the next turn restores it
    assert after.disk.fetch(None, again.prompt_ids, 0, len(again.prompt_ids)) is not None


def tail_of(directory: Path, identity: str, tokens, scope=None) -> Path:
    """The tail file after the first block of ``tokens`` (a request without a cache scope), ending at
    len(tokens)."""
    first = chain_next(chain_start(identity, scope), tokens[:BLOCK])
    return directory / f"{chain_next(first, tokens[BLOCK:], tail=True).hex()}{SUFFIX}"


def test_files_are_private_to_the_owner(engine, tokenizer, tmp_path):
    directory = tmp_path / "kv"
    sched = restarted(engine, tokenizer, directory)
    run_all(sched, [request(SYSTEM)])
    sched.disk.flush(10)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = list(directory.glob(f"*{SUFFIX}"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)


# ---- the tier alone: synthetic KV -----------------------------------------------------------------

def snapshot(tokens, start: int = 0, seed: int = 0) -> SlotSnapshot:
    """KV stand-ins: position p's values are a function of (seed, p), int8 and float32 like a real layer on a
    CPU, bfloat16 like one on an accelerator."""
    n = len(tokens) - start
    positions = np.arange(start, len(tokens))
    k = ((positions[:, None] * 7 + seed) % 251 - 125).astype(np.int8) * np.ones((1, 16), np.int8)
    s = (positions[:, None] * 0.5 + seed).astype(np.float32) * np.ones((1, 2), np.float32)
    v = (positions[:, None] * 0.25 - seed).astype(ml_dtypes.bfloat16) * np.ones((1, 4), ml_dtypes.bfloat16)
    assert k.shape[0] == n
    return SlotSnapshot(start, len(tokens), {"layer0": {"k": k, "k_scale": s}, "layer1": {"v": v}})


def cut(snap: SlotSnapshot, lo: int, hi: int) -> SlotSnapshot:
    return SlotSnapshot(lo, hi, {k: {n: a[lo - snap.start:hi - snap.start] for n, a in e.items()}
                                 for k, e in snap.layers.items()})


def assert_same(a: SlotSnapshot, b: SlotSnapshot) -> None:
    assert (a.start, a.end) == (b.start, b.end)
    for key, entry in a.layers.items():
        for name, array in entry.items():
            assert array.dtype == b.layers[key][name].dtype
            np.testing.assert_array_equal(array, b.layers[key][name])


def test_snapshots_still_on_their_way_off_the_device_are_read_on_the_writer_thread(tmp_path):
    tier = DiskTier(tmp_path, 2**30, "m")
    tokens, other = ids(22, BLOCK + 3), ids(23, BLOCK + 3)
    readers = []

    def on_its_way(start: int) -> SlotSnapshot:
        def arrive() -> dict:
            readers.append(threading.current_thread())
            return snapshot(tokens, start).layers
        return SlotSnapshot(start, len(tokens), pending=arrive)

    assert tier.store_missing("s", tokens, on_its_way) == 2  # a full block and the tail, from one snapshot
    tier.flush(10)
    assert len(readers) == 1 and readers[0] is not threading.current_thread()
    assert_same(tier.fetch("s", tokens, 0, len(tokens)), snapshot(tokens))

    def lost() -> dict:
        raise RuntimeError("the copy off the device failed")

    tier.store_missing("s", other, lambda start: SlotSnapshot(start, len(other), pending=lost))
    tier.flush(10)
    assert tier.stats()["write_errors"] == 2 and tier.match("s", other) == 0  # lost files, the tier still serves
    assert tier.match("s", tokens) == len(tokens)


def test_copies_in_flight_are_bounded_by_waiting_on_the_callers_thread(tmp_path, monkeypatch):
    """Each queued snapshot still on its way off the device holds device memory until the writer reads it:
    past COPIES_IN_FLIGHT of them, a store makes its snapshot's arrays before queueing it."""
    monkeypatch.setattr(disk_tier, "COPIES_IN_FLIGHT", 1)
    tier = DiskTier(tmp_path, 2**30, "m")
    first, second = ids(24, BLOCK), ids(25, BLOCK)
    release, readers = threading.Event(), {}

    def on_its_way(tokens, gate=None):
        def arrive() -> dict:
            readers[tokens] = threading.current_thread()
            if gate is not None:
                assert gate.wait(10)
            return snapshot(tokens).layers
        return lambda start: SlotSnapshot(start, len(tokens), pending=arrive)

    tier.store_missing("s", first, on_its_way(first, release))  # the writer waits inside this one's copy
    tier.store_missing("s", second, on_its_way(second))
    assert readers[second] is threading.current_thread()  # no room in flight: made here
    release.set()
    tier.flush(10)
    assert readers[first] is not threading.current_thread()
    assert tier.match("s", first) == tier.match("s", second) == BLOCK
    tier.store_missing("s", ids(26, BLOCK), on_its_way(ids(26, BLOCK)))  # the slot freed: queued again
    tier.flush(10)
    assert readers[ids(26, BLOCK)] is not threading.current_thread()


def test_lookups_serve_any_prefix_and_the_tail(tmp_path):
    tier = DiskTier(tmp_path, 2**30, "m")
    tokens = ids(20, 3 * BLOCK + 10)
    boundary = 2 * BLOCK + 5  # a message boundary: a tail ends there too
    assert tier.store_missing("s", tokens, lambda start: snapshot(tokens, start), (boundary,)) == 5
    tier.flush(10)
    assert tier.match("s", tokens[:boundary] + (7, 7)) == boundary
    assert_same(tier.fetch("s", tokens[:boundary] + (7,), 0, boundary), cut(snapshot(tokens), 0, boundary))
    assert tier.match("s", tokens) == len(tokens)
    assert tier.match("s", tokens + (5, 6)) == len(tokens)
    assert tier.match("s", tokens[:BLOCK + 3] + (1,)) == BLOCK  # diverges inside a block: the blocks before it
    assert tier.match("other scope", tokens) == 0
    under = (("agent", None), "adapter-fingerprint-1")  # Sequence.scope under a LoRA adapter
    tier.store_missing(under, tokens, lambda start: snapshot(tokens, start))
    tier.flush(10)
    assert tier.match(under, tokens) == len(tokens)
    assert tier.match((("agent", None), "adapter-fingerprint-2"), tokens) == 0
    assert tier.match(("agent", None), tokens) == 0
    assert DiskTier(tmp_path, 2**30, "another model").match("s", tokens) == 0
    assert_same(tier.fetch("s", tokens, 10, len(tokens) - 1), cut(snapshot(tokens), 10, len(tokens) - 1))
    # A longer conversation stores only what the disk lacks: its new blocks and a new tail.
    longer = tokens + ids(21, BLOCK)
    asked = []
    tier.store_missing("s", longer, lambda start: asked.append(start) or snapshot(longer, start))
    tier.flush(10)
    assert asked == [3 * BLOCK] and tier.match("s", longer) == len(longer)
    assert_same(tier.fetch("s", longer, 0, len(longer)), snapshot(longer))


def respell_dtype(path: Path, old: str, new: str) -> None:
    """Rewrite a disk-tier file as if its writer had recorded dtype `new` where it recorded `old`."""
    data = path.read_bytes()
    body = data[:-disk_tier.DIGEST_BYTES]
    magic, fmt, size = disk_tier._HEAD.unpack_from(body)
    header = body[disk_tier._HEAD.size:disk_tier._HEAD.size + size].replace(f'"{old}"'.encode(), f'"{new}"'.encode())
    body = disk_tier._HEAD.pack(magic, fmt, len(header)) + header + body[disk_tier._HEAD.size + size:]
    path.write_bytes(body + hashlib.blake2b(body, digest_size=disk_tier.DIGEST_BYTES).digest())


@pytest.mark.parametrize("spelling", ["<V2", "void16"])
def test_a_file_whose_arrays_read_back_as_raw_bytes_is_foreign(tmp_path, spelling):
    """Arrays recorded as raw bytes (how bfloat16 KV was once recorded: "<V2") or in a dtype this process does
    not know never reach a slot: the file is dropped and the prefix recomputed."""
    tier = DiskTier(tmp_path, 2**30, "m")
    tokens = ids(40, BLOCK)
    tier.store_missing("s", tokens, lambda start: snapshot(tokens, start))
    tier.flush(10)
    (path,) = tmp_path.rglob(f"*{SUFFIX}")
    respell_dtype(path, "bfloat16", spelling)
    assert tier.match("s", tokens) == len(tokens)  # the file is there
    assert tier.fetch("s", tokens, 0, len(tokens)) is None
    assert tier.match("s", tokens) == 0  # and gone once read


def test_the_byte_budget_evicts_the_least_recently_used(tmp_path):
    conversations = [ids(30 + i, BLOCK) for i in range(5)]
    probe = DiskTier(tmp_path / "probe", 2**30, "m")
    probe.store_missing("s", conversations[0], lambda start: snapshot(conversations[0], start))
    probe.flush(10)
    size = probe.stats()["bytes_used"]
    budget = 3 * size + size // 2  # three files (their headers' token lists differ a little in length)
    tier = DiskTier(tmp_path / "kv", budget, "m")
    for tokens in conversations[:3]:
        tier.store_missing("s", tokens, lambda start, t=tokens: snapshot(t, start))
        tier.flush(10)
        time.sleep(0.02)  # distinct mtimes
    assert tier.fetch("s", conversations[0], 0, BLOCK) is not None  # read: now the most recent
    time.sleep(0.02)
    for tokens in conversations[3:]:
        tier.store_missing("s", tokens, lambda start, t=tokens: snapshot(t, start))
        tier.flush(10)
        time.sleep(0.02)
    held = [tier.match("s", t) == BLOCK for t in conversations]
    assert held == [True, False, False, True, True]
    assert tier.stats()["evictions"] == 2 and tier.stats()["bytes_used"] <= budget


WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    from test_disk_tier import snapshot, assert_same, cut
    from scheduler_helpers import ids
    from scheduler.disk_tier import DiskTier, BLOCK
    tier = DiskTier(sys.argv[2], 2**30, "m")
    tokens = ids(40, 4 * BLOCK + 5)
    reader = sys.argv[3] == "read"
    served = 0
    for round in range(40):
        if reader:
            got = tier.fetch("s", tokens, 0, tier.match("s", tokens)) if tier.match("s", tokens) else None
            if got is not None:
                assert_same(got, cut(snapshot(tokens), 0, got.end))
                served += 1
        else:
            tier.store("s", tokens, snapshot(tokens))
            tier.flush(10)
    stats = tier.stats()
    assert stats["damaged"] == 0 and stats["write_errors"] == 0, stats
    print(served)
""")


def test_two_writers_and_a_reader_share_a_directory(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ROOT), str(tmp_path), role],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("write", "write", "read")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    tier = DiskTier(tmp_path, 2**30, "m")
    tokens = ids(40, 4 * BLOCK + 5)
    assert_same(tier.fetch("s", tokens, 0, len(tokens)), snapshot(tokens))
    assert not list(tmp_path.glob(".*.tmp")) and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 5


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    from test_disk_tier import snapshot
    from scheduler_helpers import ids
    from scheduler.disk_tier import DiskTier, BLOCK
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like ENOSPC
    tier = DiskTier(sys.argv[2], 2**30, "m")
    small = ids(50, BLOCK)
    tier.store_missing("s", small, lambda start: snapshot(small, start))
    tier.flush(10)
    size = tier.stats()["bytes_used"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
    big = ids(51, 2 * BLOCK)
    tier.store_missing("s", big, lambda start: snapshot(big, start))
    assert tier.flush(10)
    stats = tier.stats()
    assert stats["write_errors"] == 2 and tier.match("s", big) == 0, stats
    assert tier.fetch("s", small, 0, BLOCK) is not None
    print("ok")
""")


def test_a_full_disk_loses_entries_not_requests(tmp_path):
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(ROOT), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_killed_writers_temporary_files_are_cleared_once_stale(tmp_path):
    fresh, stale = tmp_path / ".a.kv.1.2.tmp", tmp_path / ".b.kv.1.2.tmp"
    fresh.write_bytes(b"x")
    stale.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    DiskTier(tmp_path, 2**30, "m")
    assert fresh.exists() and not stale.exists()


def test_the_directory_comes_from_the_flag_the_config_the_environment_or_the_cache_dir(tmp_path, monkeypatch):
    from agents.runtime import disk_tier_dir
    from server.cli import build_parser
    from server.run import serve_config

    config_file = tmp_path / "c.yaml"
    config_file.write_text("scheduler:\n  disk_tier_dir: /srv/kv\n  disk_tier_bytes: 1000\n")
    off_file = tmp_path / "off.yaml"
    off_file.write_text("scheduler:\n  disk_tier_dir: off\n")  # YAML's false: read as "off"
    parse = build_parser().parse_args
    assert serve_config(parse(["serve", "--config", str(config_file)])).runtime_options().disk_tier_dir == "/srv/kv"
    flagged = serve_config(parse(["serve", "--config", str(config_file), "--kv-disk-dir", "off"])).runtime_options()
    assert flagged.disk_tier_dir == "off" and flagged.disk_tier_bytes == 1000
    assert serve_config(parse(["serve", "--config", str(off_file)])).runtime_options().disk_tier_dir == "off"
    assert disk_tier_dir("off") is None and disk_tier_dir("/x/kv") == "/x/kv"
    monkeypatch.setenv("SLOTSERVE_KV_DISK_DIR", str(tmp_path / "env-kv"))
    assert disk_tier_dir(None) == str(tmp_path / "env-kv")
    monkeypatch.delenv("SLOTSERVE_KV_DISK_DIR")
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert disk_tier_dir(None) == str(tmp_path / "cache" / "kv")  # on by default, beside the other caches
    assert serve_config(parse(["serve"])).runtime_options().disk_tier_dir is None
