"""Hosts' beats on shared storage (producers/launcher/liveness.py) and a spare agent's
view of the run: its newest world, whether it finished, which of its hosts are gone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from harness.hosts import EXAMPLE, environment
from trainguard.producers.launcher.config import free_port
from trainguard.producers.launcher.liveness import (
    BEAT_S,
    HostBeat,
    Liveness,
    LossWatch,
    hosts_dir,
    newest_world,
)


def journal(ckpt: Path, node: str, *records: dict[str, object]) -> None:
    path = hosts_dir(ckpt / ".trainguard") / node / "launcher.actions.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


def test_a_host_is_gone_once_its_counter_stops_changing_on_the_observers_clock(tmp_path: Path) -> None:
    now = [100.0]
    beat = HostBeat(tmp_path, "host-a", interval_s=0.05).start()
    live = Liveness(tmp_path, clock=lambda: now[0])
    assert live.stale(["host-a", "host-z"], 3.0) == []  # the first look: nothing judged yet
    for _ in range(3):  # the counter moves while the observer's clock runs
        time.sleep(0.2)
        now[0] += 2.0
        assert live.stale(["host-a"], 3.0) == []
    now[0] += 2.0
    assert live.stale(["host-z"], 3.0) == ["host-z"]  # never beat: gone after stale_s
    beat.stop()
    live.stale(["host-a"], 3.0)  # its last value, seen once more
    now[0] += 3.5
    assert live.stale(["host-a"], 3.0) == ["host-a"]


def test_a_host_waiting_to_join_is_told_apart_from_a_spare_come_for_a_lost_host(tmp_path: Path) -> None:
    """A survivor's agent sees a host waiting below MAX: a membership change only once every
    other host of its world beat through the watch; the loss of the one that stopped."""
    now = [0.0]
    beats = {node: HostBeat(tmp_path, node, interval_s=0.02).start() for node in ("host-a", "host-c")}
    try:
        time.sleep(0.1)
        joining = LossWatch(tmp_path, ["host-a", "host-c"], 3.0, clock=lambda: now[0])
        for _ in range(4):  # both beat: watched, then judged a join, not before stale_s + a beat
            time.sleep(0.1)
            now[0] += 1.0
            assert joining.lost() == ({} if now[0] >= 3.0 + BEAT_S else None)
        beats["host-c"].stop()  # host-c is gone: a spare joins for it
        lost = LossWatch(tmp_path, ["host-a", "host-c"], 3.0, clock=lambda: now[0])
        for _ in range(2):
            time.sleep(0.1)
            now[0] += 1.0
            assert lost.lost() is None
        now[0] += 1.5
        assert lost.lost() == {"host-c": 3.5}  # named with how long it has been quiet
    finally:
        for beat in beats.values():
            beat.stop()


def test_the_newest_world_and_its_clean_end_come_from_every_hosts_journal(tmp_path: Path) -> None:
    assert newest_world(tmp_path / ".trainguard") == (-1, (), False)
    journal(tmp_path, "host-a", {"op": "attempt", "attempt": 0, "nodes": ["host-a", "host-b"]})
    journal(tmp_path, "host-b", {"op": "attempt", "attempt": 0, "nodes": ["host-a", "host-b"]})
    journal(tmp_path, "spare-1", {"op": "attempt", "attempt": 1, "nodes": ["host-a", "spare-1"]})
    assert newest_world(tmp_path / ".trainguard") == (1, ("host-a", "spare-1"), False)
    journal(tmp_path, "host-b", {"op": "ended", "attempt": 0, "end": "ok"})  # an older attempt's
    assert newest_world(tmp_path / ".trainguard")[2] is False
    torn = hosts_dir(tmp_path / ".trainguard") / "host-a" / "launcher.actions.jsonl"
    torn.open("a").write('{"op": "ended", "att')
    journal(tmp_path, "spare-1", {"op": "ended", "attempt": 1, "end": "ok"})
    assert newest_world(tmp_path / ".trainguard") == (1, ("host-a", "spare-1"), True)


def test_a_spare_the_run_finished_without_ends_ok_and_joins_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    journal(ckpt, "host-a", {"op": "attempt", "attempt": 0, "nodes": ["host-a"]})
    journal(ckpt, "host-a", {"op": "ended", "attempt": 0, "end": "ok"})
    done = subprocess.run(
        [sys.executable, "-m", "trainguard", "launch", "--offline", "--spare", "--nnodes", "1:2",
         "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "spare-test",
         "--local-addr", "127.0.0.1", "--node-name", "spare-1", "--checkpoint-dir", str(ckpt), str(EXAMPLE)],
        env=environment(10), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ok: spare spare-1 not needed: run spare-test finished" in done.stdout + done.stderr
    spare_journal = hosts_dir(ckpt / ".trainguard") / "spare-1" / "launcher.actions.jsonl"
    assert not [r for r in map(json.loads, spare_journal.open()) if r.get("op") == "attempt"]
