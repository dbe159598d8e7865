"""What `trainguard launch` tells (issue 44): every rank's output on the console prefixed by
its rank, as torchrun's --tee shows it, and in a log file per rank and attempt, whatever
the restart mode (producers/launcher/rank_output.py); torchrun's --tee, --redirects and
--log-dir; and a run launched with torchrun's flags alone (no --checkpoint-dir, no
--run-id) checkpointing to a default place it names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainguard.cli import app
from trainguard.producers.launcher.config import default_run_id
from trainguard.producers.launcher.rank_output import Console, Owner, RankOutput

torch = pytest.importorskip("torch")
Std = torch.distributed.elastic.multiprocessing.Std

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs" / "examples" / "train_tiny.py"

#: One line to stdout and one to stderr per rank (a warm spare prints nothing until it is one).
PRINTS = textwrap.dedent(
    """
    import os, sys
    from trainguard.producers.training import inprocess

    def main():
        rank = os.environ["RANK"]
        print(f"out of rank {rank}", flush=True)
        print(f"err of rank {rank}", file=sys.stderr, flush=True)

    if __name__ == "__main__":
        inprocess.run(main)
    """
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000", **extra}
    for inherited in (
        "TRAINGUARD_HOME",
        "TRAINGUARD_CHECKPOINT_DIR",
        "TRAINGUARD_STATE_DIR",
        "TRAINGUARD_BOOTSTRAP",
    ):
        env.pop(inherited, None)
    return env


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        ([], {"out": True, "err": True}),
        (["--tee", "1", "--redirects", "2"], {"out": True, "err": False}),
        (["--warm-spares", "1", "--log-dir", "{tmp}/logs"], {"out": True, "err": True}),
    ],
    ids=["full", "full-stderr-redirected", "in-process-log-dir"],
)
def test_rank_output_is_on_the_console_prefixed_by_rank_and_in_a_file_per_rank(
    tmp_path: Path, flags: list[str], shown: dict[str, bool]
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(PRINTS)
    flags = [f.format(tmp=tmp_path) for f in flags]
    argv = [sys.executable, "-m", "trainguard", "launch", "--nproc", "2", "--offline", "--self-test", "off"]
    argv += ["--run-id", "output", "--checkpoint-dir", str(tmp_path / "ckpt"), *flags]
    argv += ["--", sys.executable, str(script)]
    done = subprocess.run(argv, env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):  # stdout's lines to the console's stdout, stderr's to its stderr
        assert (f"[rank{rank}]:out of rank {rank}" in done.stdout.splitlines()) is shown["out"], done.stdout
        assert (f"[rank{rank}]:err of rank {rank}" in done.stderr.splitlines()) is shown["err"], done.stderr
        assert f"err of rank {rank}" not in done.stdout and f"out of rank {rank}" not in done.stderr
    logs = (
        tmp_path / "logs" / "output" if "--log-dir" in flags else tmp_path / "ckpt" / ".trainguard" / "logs"
    )
    assert f"rank logs in {logs}/attempt-N/rank-R/" in done.stderr
    for rank in range(2):  # the files hold every stream, unprefixed, whatever the console shows
        files = logs / "attempt-0" / f"rank-{rank}"
        assert (files / "stdout.log").read_text() == f"out of rank {rank}\n"
        assert f"err of rank {rank}\n" in (files / "stderr.log").read_text()
    if "--warm-spares" in flags:  # each process's own streams, the spare's included
        assert len(list((logs / "workers").glob("spare-*.stdout.log"))) == 3


def test_launch_with_torchruns_flags_alone_checkpoints_to_the_default_place_it_names(tmp_path: Path) -> None:
    """`trainguard launch --nproc 2 -- python train_tiny.py`: no --checkpoint-dir, no
    --run-id (offline from TRAINGUARD_OFFLINE). The run id is made from the command and
    the directory and printed; checkpoints, the launcher's files and the rank logs land in
    ./.trainguard/runs/RUN_ID."""
    command = [sys.executable, str(EXAMPLE)]
    env = clean_env(TRAINGUARD_OFFLINE="1", TRAIN_STEPS="12", TRAIN_CHECKPOINT_EVERY="5")
    argv = [sys.executable, "-m", "trainguard", "launch", "--nproc", "2", "--", *command]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"^run id (\S+) \(the default", done.stderr, re.M)
    assert found is not None, done.stderr
    run_id = found[1]
    assert run_id == default_run_id(command, tmp_path.resolve()) and run_id.startswith("train_tiny-")
    run = tmp_path.resolve() / ".trainguard" / "runs" / run_id
    assert f"checkpoints in {run / 'checkpoints'} (the default" in done.stderr
    assert "storage every host mounts" in done.stderr  # the caveat, said once
    assert done.stderr.count("storage every host mounts") == 1
    assert sorted(p.parent.name for p in (run / "checkpoints").glob("step-*/VALIDATED")) == [
        "step-000000004",
        "step-000000009",
    ]
    assert (run / "launcher.actions.jsonl").exists()  # the launcher's files beside them, not inside
    assert not (run / "checkpoints" / ".trainguard").exists()
    assert (run / "logs" / "attempt-0" / "rank-1" / "stderr.log").exists()


def test_the_default_run_id_is_the_same_for_the_same_command_here_and_only_then(tmp_path: Path) -> None:
    here = default_run_id(["python", "train.py", "--lr", "3e-4"], tmp_path)
    assert here == default_run_id(["python", "train.py", "--lr", "3e-4"], tmp_path)
    assert re.fullmatch(r"train-[0-9a-f]{8}", here)
    assert here != default_run_id(["python", "train.py", "--lr", "1e-4"], tmp_path)
    assert here != default_run_id(["python", "train.py", "--lr", "3e-4"], tmp_path / "other")
    assert default_run_id(["./my job"], tmp_path).startswith("my-job-")


def test_across_hosts_a_checkpoint_dir_and_a_run_id_are_required_and_bad_tee_is_refused() -> None:
    hosts = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:29999"]
    cases = [
        ([*hosts, "--rdzv-id", "r"], "across hosts, --checkpoint-dir is required"),
        (
            [*hosts, "--checkpoint-dir", "/shared/ckpt"],
            "across hosts, --run-id (or torchrun's --rdzv-id) is required",
        ),
        (["--nproc", "2", "--tee", "4"], "--tee must be 0-3"),
        (["--nproc", "2", "--redirects", "x"], "--redirects must be 0-3"),
    ]
    for flags, message in cases:
        done = CliRunner().invoke(app, ["launch", "--offline", *flags, "--", "train.py"])
        assert done.exit_code == 2, done.output
        lines = [line for line in done.output.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], lines


def test_what_each_stream_shows_on_the_console() -> None:
    """torchrun's rules: --tee shows a stream prefixed, --redirects keeps it off (--tee wins),
    neither shows it as the rank wrote it; per local rank with a mapping (a spare: none)."""
    default = Console()
    assert (
        default.prefix(Std.OUT, 0, "rank0") == "[rank0]:"
        and default.prefix(Std.ERR, None, "spare-1") == "[spare-1]:"
    )
    plain = Console(tee="0")
    assert plain.prefix(Std.OUT, 3, "rank3") == ""
    quiet = Console(tee="0", redirects="3")
    assert quiet.prefix(Std.OUT, 0, "rank0") is None and quiet.prefix(Std.ERR, 0, "rank0") is None
    assert Console(tee="3", redirects="3").prefix(Std.ERR, 0, "rank0") == "[rank0]:"
    mapped = Console(tee="0:1,1:2", redirects="1:1")
    assert mapped.prefix(Std.OUT, 0, "rank0") == "[rank0]:" and mapped.prefix(Std.ERR, 0, "rank0") == ""
    assert mapped.prefix(Std.OUT, 1, "rank1") is None and mapped.prefix(Std.ERR, 1, "rank1") == "[rank1]:"
    assert mapped.prefix(Std.OUT, None, "spare-0") == ""


def test_a_process_that_changes_rank_has_its_lines_split_into_each_ranks_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process: a spare's lines are its own until it takes a rank, then that rank's,
    in the rank's file of the attempt it serves; a last line without its newline is kept."""
    worker = tmp_path / "workers" / "spare-2.stdout.log"
    worker.parent.mkdir()
    owner = Owner("spare-2")
    output = RankOutput(Console(), poll_s=0.01)
    output.follow(worker, Std.OUT, lambda: owner)
    with worker.open("w") as fh:
        fh.write("imported\n")
        fh.flush()
        seen, deadline = "", time.monotonic() + 10
        while "[spare-2]:imported" not in seen:  # read by the thread, as the spare's
            assert time.monotonic() < deadline, seen
            time.sleep(0.01)
            seen += capsys.readouterr().out
        owner = Owner("rank1", 1, tmp_path / "attempt-3" / "rank-1")  # it took rank 1 in attempt 3
        fh.write("step 1\nno newline")
        fh.flush()
    output.drain([worker])
    assert capsys.readouterr().out.splitlines() == ["[rank1]:step 1", "[rank1]:no newline"]
    assert (tmp_path / "attempt-3" / "rank-1" / "stdout.log").read_text() == "step 1\nno newline\n"
    output.close()
