"""A start-up failure that repeats is code, not hardware (issue 44): `trainguard launch`
stops a script that fails the same way before its first step on two attempts, and keeps
restarting one whose start-up errors differ or that fails after a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.producers.launcher.plan import Placement
from trainguard.producers.launcher.records import RankEnd, RestartCause, RestartPhases
from trainguard.producers.launcher.startup import StartupFailures, last_exception, normalise, reported_error
from trainguard.producers.launcher.world import World

#: Raises before its first step, the same error on every rank and attempt but for its
#: pid, rank, address, time and tmp path (nothing heavy imported).
SAME_ERROR = textwrap.dedent(
    """
    import os, sys, tempfile, time
    {before}
    dir = os.path.join(tempfile.gettempdir(), "tmp" + os.urandom(4).hex())
    raise RuntimeError(
        f"SyncBatchNorm layers only work with GPU modules (rank {{os.environ['RANK']}}, "
        f"pid {{os.getpid()}}, peer 127.0.0.1:{{os.environ['MASTER_PORT']}}, t={{time.time()}}, "
        f"cache {{dir}}/x.bin)"
    )
    """
)

#: After torch.distributed.init_process_group with gloo (a real script's start-up).
AFTER_INIT = "import torch.distributed as dist; dist.init_process_group('gloo')"

#: A different error on each attempt: its words differ, not only its digits.
DIFFERENT_ERROR = textwrap.dedent(
    """
    import os
    words = ["zero", "one", "two", "three", "four", "five"]
    raise ValueError(f"bad config on attempt {words[int(os.environ['TRAINGUARD_ATTEMPT'])]}")
    """
)

#: The same error, after a completed step (the progress file the Supervisor writes).
AFTER_A_STEP = textwrap.dedent(
    """
    import os
    with open(os.environ["TRAINGUARD_PROGRESS_FILE"], "w") as fh:
        fh.write("%20d\\n" % 0)
    raise RuntimeError("loss exploded")
    """
)


def launch(tmp_path: Path, script: str, max_restarts: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`trainguard launch --offline --nproc 2 --ranks-per-node 1` (two nodes) of `script`."""
    path = tmp_path / "rank.py"
    path.write_text(script)
    flags = f"launch --offline --nproc 2 --ranks-per-node 1 --run-id startup --max-restarts {max_restarts}"
    argv = [sys.executable, "-m", "trainguard", *flags.split(), "--checkpoint-dir", str(tmp_path / "ckpt")]
    argv += ["--", sys.executable, str(path)]
    env = {**os.environ, "COLUMNS": "1000"}  # the final line unwrapped
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    return done, tmp_path / "ckpt" / ".trainguard"


def records(run_dir: Path, name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("before", ["", AFTER_INIT], ids=["no-imports", "after-gloo-init"])
def test_a_script_failing_at_start_up_identically_twice_stops_with_one_clear_reason_after_the_second_attempt(
    tmp_path: Path, before: str
) -> None:
    done, run_dir = launch(tmp_path, SAME_ERROR.format(before=before), max_restarts=5)
    out = done.stdout + done.stderr
    assert done.returncode == 75, out  # paused, as after a PauseRun
    last = done.stderr.strip().splitlines()[-1]  # the CLI's console is stderr
    assert last.startswith("paused: paused at start-up by the launcher: attempts 0 and 1 failed before"), out
    assert "same error on 2 different nodes (node-0000, node-0001)" in last, out
    assert "data or code, not hardware" in last and "RuntimeError: SyncBatchNorm layers only work" in last
    assert last.endswith("(2 attempts)"), out
    assert out.count("Traceback (most recent call last):") >= 2  # the ranks' stderr still shown
    journal = records(run_dir, "launcher.actions.jsonl")
    assert [r["attempt"] for r in journal if r["op"] == "attempt"] == [0, 1]  # exactly two
    assert not [r for r in journal if r.get("quarantine") or r.get("release")]  # nobody quarantined
    assert not (run_dir / "quarantine.jsonl").exists() and not (run_dir / "attempt-2").exists()
    first, second = records(run_dir, "restarts.jsonl")
    assert (first["to_attempt"], first["startup"], first["decision"]) == (1, True, "")
    assert (second["cause"], second["to_attempt"], second["decision"]) == ("crash", None, "pause")
    assert second["decision_reason"] == last.removeprefix("paused: ").removesuffix(" (2 attempts)")
    assert second["error_signature"] == first["error_signature"]
    assert str(second["error_signature"]).startswith("RuntimeError: SyncBatchNorm layers only work")
    assert second["error_nodes"] == ["node-0000", "node-0001"]


def test_a_script_failing_at_start_up_differently_each_time_is_restarted_up_to_max_restarts(
    tmp_path: Path,
) -> None:
    done, run_dir = launch(tmp_path, DIFFERENT_ERROR, max_restarts=2)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "failed: crash after 2 restarts (max_restarts)" in out and "(3 attempts)" in out
    recs = records(run_dir, "restarts.jsonl")
    assert [(r["to_attempt"], r["startup"], r["decision"]) for r in recs] == [
        (1, True, ""),
        (2, True, ""),
        (None, True, ""),
    ]
    assert [r["error"] for r in recs] == [
        f"ValueError: bad config on attempt {w}" for w in ("zero", "one", "two")
    ]


def test_the_same_error_after_a_completed_step_is_restarted_up_to_max_restarts(tmp_path: Path) -> None:
    done, run_dir = launch(tmp_path, AFTER_A_STEP, max_restarts=1)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "failed: crash after 1 restarts (max_restarts)" in out and "(2 attempts)" in out
    recs = records(run_dir, "restarts.jsonl")
    assert [(r["startup"], r["decision"], r["error"]) for r in recs] == [
        (False, "", "RuntimeError: loss exploded")
    ] * 2


def test_the_signature_normalises_what_differs_between_ranks_and_attempts() -> None:
    nodes = ("gpu-a17", "node-0001")
    one = normalise(
        "RuntimeError: rank 3 (pid 4242) on gpu-a17 at 10.0.3.17:29500 failed at 2026-12-06T05:22:34.4 "
        "reading /tmp/tmpab_x9q/shard.bin (handle 0x7f3a2c00, id 3fa85f64-5717-4562-b3fc-2c963f66afa6, "
        "digest 9f86d081884c7d65)",
        nodes,
    )
    two = normalise(
        "RuntimeError: rank 12 (pid 17) on node-0001 at 10.0.0.2:41234 failed at 2026-12-07T11:02:09.9 "
        "reading /tmp/tmpq3k2zz/shard.bin (handle 0x55d0e1a0, id 0b1c2d3e-0000-4a4a-9b9b-000000000001, "
        "digest 00aa11bb22cc33dd)",
        nodes,
    )
    assert one == two
    assert one == (
        "RuntimeError: rank N (pid N) on <node> at N.N.N.N:N failed at N-N-NTN:N:N.N reading <tmp> "
        "(handle <hex>, id <hex>, digest <hex>)"
    )
    # words are kept: a different error stays different, and so does its type
    assert normalise("ValueError: bad config on attempt one") != normalise(
        "ValueError: bad config on attempt two"
    )
    assert normalise("ValueError: x") != normalise("TypeError: x")
    assert normalise("OSError:   a\tb  ") == "OSError: a b"  # spacing is not the error


def test_the_last_exception_of_a_ranks_stderr_and_its_error_file(tmp_path: Path) -> None:
    stderr = textwrap.dedent(
        """\
        some warning
        Traceback (most recent call last):
          File "x.py", line 3, in <module>
        KeyError: 'lr'

        During handling of the above exception, another exception occurred:

        [rank1]: Traceback (most recent call last):
        [rank1]:   File "x.py", line 5, in <module>
        [rank1]:     raise ValueError("no lr")
        [rank1]:     ^^^^^^^^^^^^^^^^^^^^^^^^^
        [rank1]: ValueError: no lr
        [W1206 05:22:34 ProcessGroup.cpp:1] Warning: destroy_process_group() was not called
        """
    )
    assert last_exception(stderr) == "ValueError: no lr"
    assert last_exception("Segmentation fault (core dumped)\n") == ""
    log = tmp_path / "stderr.log"
    log.write_text("x" * 100_000 + "\n" + stderr)  # only its end is read
    assert reported_error(None, log) == "ValueError: no lr"
    error_file = tmp_path / "error.json"  # torch elastic's @record wins over stderr
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: boom\nmore", "extraInfo": {}}}))
    assert reported_error(error_file, log) == "RuntimeError: boom"
    assert reported_error(tmp_path / "absent.json", tmp_path / "absent.log") == ""


def crash(attempt: int, rank: int, node: str) -> RestartPhases:
    return RestartPhases(
        run_id="r", interruption=attempt, cause=RestartCause.CRASH, detail="", from_attempt=attempt,
        to_attempt=None, rank=rank, node=node, exit_code=1, signal=None, command_id="", fault_ts=0.0,
        detected_ts=0.0,
    )  # fmt: skip


def fail_at_start(
    failures: StartupFailures, run_dir: Path, attempt: int, nodes: tuple[str, ...], error: str
) -> str | None:
    """Attempt `attempt` of a one-rank-per-node world on `nodes`, this agent's rank 0 on
    nodes[0] raising `error` before any step."""
    log = run_dir / f"attempt-{attempt}" / "stderr.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"Traceback (most recent call last):\n  File 'x.py'\n{error}\n")
    world = World(attempt, Placement(nodes, 1, len(nodes), {}), -1, (0,), "127.0.0.1", None)
    exits = [RankEnd(attempt, 0, nodes[0], 1, 0.0, False)]
    return failures.after_attempt(world, crash(attempt, 0, nodes[0]), exits, {0: (None, log)})


def test_across_hosts_the_other_hosts_start_up_failures_count_and_one_node_twice_is_not_enough(
    tmp_path: Path,
) -> None:
    """Each agent sees its own node; the same error on another host's node (its record in
    its run dir beside this one's) makes the second node. On one node alone, twice is not
    code for sure (that node may be bad), unless the run has no other node."""
    hosts = tmp_path / "hosts"
    alone = StartupFailures(hosts / "a")
    assert fail_at_start(alone, hosts / "a", 0, ("a", "b"), "OSError: no such file x (pid 1)") is None
    assert fail_at_start(alone, hosts / "a", 1, ("a", "b"), "OSError: no such file x (pid 2)") is None

    failures = StartupFailures(hosts / "a", hosts)
    assert fail_at_start(failures, hosts / "a", 2, ("a", "b"), "OSError: no such file x (pid 3)") is None
    other = StartupFailures(hosts / "b", hosts)  # host b's agent, its rank failing alike
    assert fail_at_start(other, hosts / "b", 2, ("b", "a"), "OSError: no such file x (pid 4)") is None
    reason = fail_at_start(failures, hosts / "a", 3, ("a", "b"), "OSError: no such file x (pid 5)")
    assert reason is not None and "attempts 2 and 3" in reason and "2 different nodes (a, b)" in reason

    one_node = StartupFailures(tmp_path / "one")
    assert fail_at_start(one_node, tmp_path / "one", 0, ("a",), "KeyError: 'lr'") is None
    reason = fail_at_start(one_node, tmp_path / "one", 1, ("a",), "KeyError: 'lr'")
    assert reason is not None and "on the run's only node" in reason
