"""What an agent across hosts tells and records (issue 44), piece by piece, without
launching a run (test_multihost_recipe.py runs the whole story): the quarantine list's
one line per decision, the refusal of a quarantined host's agent before anything else,
the lost-peer tracebacks kept off the console, and the story's lines."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainguard.producers.launcher.peer_tracebacks import PeerLossFilter
from trainguard.producers.launcher.plan import Placement
from trainguard.producers.launcher.records import RestartCause, RestartPhases
from trainguard.producers.launcher.shared_quarantine import SharedQuarantine, refused_at_start
from trainguard.producers.launcher.story import headline, restart_line, short_peer_error, world_lines
from trainguard.producers.launcher.world import World

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
    "[127.0.0.1]:6061: Connection reset by peer. This is typically caused by a remote worker hanging"
)


def test_a_host_seen_lost_by_every_survivor_is_one_decision_on_the_shared_list(tmp_path: Path) -> None:
    """Each survivor sees the same host lost and every agent executes the same
    QuarantineNode: one line, the first observer's reason. A release, and a later
    quarantine, are decisions of their own."""
    listed = SharedQuarantine(tmp_path)
    barrier = threading.Barrier(4)

    def observe(agent: str) -> None:
        barrier.wait()
        listed.add("host-b", f"host lost: seen by {agent}", by=agent)

    threads = [threading.Thread(target=observe, args=(f"host-{n}",)) for n in "acde"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not listed.add("host-b", "node host-b caused interruption 1 (the processor's)", by="host-a")
    (line,) = listed.path.read_text().splitlines()
    assert json.loads(line)["reason"].startswith("host lost: seen by host-")
    assert listed.release("host-b", by="host-a") and not listed.release("host-b", by="host-c")
    assert listed.add("host-b", "wrong answers", by="host-c")
    assert [json.loads(r)["out"] for r in listed.path.read_text().splitlines()] == [True, False, True]
    with listed.path.open("ab") as fh:
        fh.write(b'{"node": "host-d", "out": tr')  # a writer killed mid-line
    assert listed.add("host-e", "host lost", by="host-a")  # starts on a line of its own
    assert SharedQuarantine(tmp_path).nodes() == {"host-b": "wrong answers", "host-e": "host lost"}


def test_a_quarantined_hosts_agent_is_refused_before_anything_else(tmp_path: Path) -> None:
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    SharedQuarantine(state).add(
        "host-b", "host lost: its agent left the rendezvous during attempt 0", by="host-a"
    )
    SharedQuarantine(ckpt / ".trainguard").add("host-c", "failed its self-test: gemm", by="host-c")
    assert refused_at_start(state, str(ckpt), "host-b", "demo") == (
        "host-b is quarantined for run demo (host lost: its agent left the rendezvous during attempt 0): "
        "it does not rejoin"
    )
    assert refused_at_start(state, str(ckpt), "host-a", "demo") is None
    assert refused_at_start(None, str(ckpt), "host-c", "demo") is not None  # DIR/.trainguard
    assert refused_at_start(None, f"file://{ckpt}", "host-c", "demo") is not None
    assert refused_at_start(None, "s3://bucket/ckpt", "host-c", "demo") is None  # needs --state-dir

    # The CLI: one line, exit 1, at once (torch never imported: ~0.5 s idle; the bound is
    # for a loaded machine), nothing written.
    imported = tmp_path / "torch-imported"
    trainguard = (
        "import atexit, runpy, sys; "
        f"atexit.register(lambda: open({str(imported)!r}, 'w').write(str('torch' in sys.modules))); "
        "runpy.run_module('trainguard', run_name='__main__', alter_sys=True)"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", trainguard, "launch", "--nnodes", "2:3", "--nproc-per-node", "1",
         "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "demo", "--state-dir", str(state),
         "--checkpoint-dir", str(ckpt), "--node-name", "host-b", "--offline", "train.py"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.splitlines() == [refused_at_start(state, str(ckpt), "host-b", "demo")]
    assert imported.read_text() == "False" and took < 10, took
    assert not (state / "hosts").exists()


def test_a_ranks_lost_peer_traceback_stays_off_the_console_its_own_error_does_not() -> None:
    out = io.StringIO()
    console = PeerLossFilter(out, settle_s=0.2)
    lost = (
        "[rank0]:[rank0]: Traceback (most recent call last):\n"
        '[rank0]:[rank0]:   File "train.py", line 9, in <module>\n'
        "[rank0]:[rank0]:     work.wait()\n"
    )
    console.write("trainguard host-a: attempt 0 on host-a, host-b (rank 0 here) starts from scratch\n")
    console.write(lost)  # the exception line comes in a later write
    console.write('[rank1]:Traceback (most recent call last):\n[rank1]:  File "train.py", line 3\n')
    console.write(f"[rank0]:[rank0]: RuntimeError: {GLOO}\n")
    console.write(
        "[rank1]:ValueError: bad batch\nTraceback (most recent call last):\nOSError: reset by peer\n"
    )
    console.write("[rank2]:step 10\n")
    time.sleep(0.6)
    console.close()
    shown = out.getvalue()
    assert "RuntimeError" not in shown and "work.wait" not in shown, shown
    assert console.dropped == {"[rank0]:": f"RuntimeError: {GLOO}"}
    assert '[rank1]:Traceback (most recent call last):\n[rank1]:  File "train.py", line 3\n' in shown
    assert "[rank1]:ValueError: bad batch\n" in shown
    assert "Traceback (most recent call last):\nOSError: reset by peer\n" in shown  # the agent's own
    assert shown.startswith("trainguard host-a:") and "[rank2]:step 10\n" in shown


def interruption(cause: RestartCause, detail: str, rank: int = 0) -> RestartPhases:
    return RestartPhases(
        run_id="demo", interruption=0, cause=cause, detail=detail, from_attempt=0, to_attempt=None,
        rank=rank, node="host-a", exit_code=1, signal=None, command_id="", fault_ts=100.0, detected_ts=100.1,
    )  # fmt: skip


def world(node: str, before: tuple[str, ...], after: tuple[str, ...], left: dict[str, str]) -> World:
    same = len(before) == len(after)
    moved = {
        i: (old, new) for i, (old, new) in enumerate(zip(before, after, strict=False)) if same and old != new
    }
    placement = Placement(after, 2, 2 * len(after), moved)
    return World(
        1, placement, 49, tuple(placement.ranks_of(node)), "127.0.0.1", 1234,
        before=Placement(before, 2, 2 * len(before), {}), left=left,
    )  # fmt: skip


def test_the_story_names_the_lost_host_who_replaced_it_the_ranks_moved_and_the_step() -> None:
    hosts, after = ("host-a", "host-b", "host-c"), ("host-a", "spare-1", "host-c")
    why = {"host-b": "host lost: its agent left the rendezvous during attempt 0"}
    crash = interruption(RestartCause.CRASH, f"rank 0 exited 1 (lost a peer: {GLOO})")
    logs = {0: Path("/run/hosts/host-a/logs/attempt-0/rank-0/stderr.log"), 1: None}
    lines = world_lines(world("host-a", hosts, after, why), crash, {0: GLOO, 1: GLOO}, logs)
    assert lines == [
        "host-b lost: its agent left the rendezvous during attempt 0; so ranks 0, 1 here lost their peer "
        "(Read error [127.0.0.1]:6061: Connection reset by peer; "
        "traceback in /run/hosts/host-a/logs/attempt-0/rank-0/stderr.log)",
        "spare-1 replaces host-b: ranks 2, 3 move host-b -> spare-1",
        "attempt 1 on host-a, spare-1, host-c (ranks 0, 1 here) restores from checkpoint step 49",
    ]
    # The spare said why it came when it joined; at the round, the replacement and its start.
    called = interruption(RestartCause.HOST_LOST, "its beat stopped 3.1 s ago, in attempt 0", -1)
    assert world_lines(world("spare-1", hosts, after, why), called, {}, {}) == [
        "spare-1 replaces host-b: ranks 2, 3 move host-b -> spare-1",
        "attempt 1 on host-a, spare-1, host-c (ranks 2, 3 here) restores from checkpoint step 49",
    ]
    # No host lost (another host's rank failed on its own): the attempt's end, then the start.
    again = world_lines(world("host-a", hosts, hosts, {}), crash, {0: GLOO}, {0: None})
    error = "Read error [127.0.0.1]:6061: Connection reset by peer"
    assert again[0] == f"attempt 0 ended: rank 0 here lost its peer ({error})"
    # A quarantined host is out of the run, not lost; a smaller world is renumbered.
    hung = {"host-c": "node host-c caused interruption 4e13 of run demo (hang: ...)"}
    lines = world_lines(world("host-a", hosts, ("host-a", "host-b"), hung), crash, {}, {})
    assert lines[:2] == [
        "host-c out of the run: node host-c caused interruption 4e13 of run demo (hang: ...)",
        "the world re-forms without host-c: 2 hosts, 4 ranks, renumbered",
    ]

    crash.hosts_lost, crash.replaced_by = ["host-b"], {"host-b": "spare-1"}
    assert headline(crash) == (
        "host-b (replaced by spare-1) lost: rank 0 exited 1 "
        "(lost a peer: Read error [127.0.0.1]:6061: Connection reset by peer)"
    )
    crash.to_attempt, crash.resumed_from_step, crash.restart_s, crash.detect_s = 1, 49, 8.04, 0.1
    crash.reschedule_s, crash.rendezvous_s, crash.restore_from = 4.3, 4.2, {"storage": 2}
    assert restart_line(crash) == (
        "restart 0 done: R 8.0 s from the fault to attempt 1's first step here (detect 0.1 s, "
        "reschedule 4.3 s, of which rendezvous 4.2 s); restored from checkpoint step 49 (storage)"
    )
    assert short_peer_error("NCCL communicator was aborted on rank 3. Original reason: x") == (
        "NCCL communicator was aborted on rank 3"
    )
