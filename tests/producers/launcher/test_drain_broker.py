"""DrainNode end to end through the launcher (issue 46): a real signed command through
Kafka to a real `trainguard launch --restart in-process --warm-spares 2` of
docs/examples/train_tiny.py (four gloo ranks on node-0000 and node-0001, two a node),
no processor: the command is the operator's.

node-0001 is drained with within_s 1 s (the example checkpoints only when asked, so the
deadline, carried to the ranks in the resize key, is the boundary): ranks 2 and 3 leave
with the others at the step they agree on, after its checkpoint is validated; two warm
spares take them on spare-0000, ranks 0 and 1 stay in their processes, the next attempt
resumes from exactly that step, node-0001 is quarantined, and the final weights and
optimizer state are bitwise those of an uninterrupted run. With no spare ready under
elastic training, the same drain shrinks the world, which grows back at a later boundary."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names
from trainguard.schemas import AckStatus, DrainNode, Reason, ReasonCode

from .drain_runs import ELASTIC, assert_drained_at_the_boundary, assert_same_tensors, launch, send
from .elastic_checks import assert_each_sample_once, assert_like_clean, trained
from .test_launcher_restart import acks_of

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.broker

SECRET = "drain-broker-test-secret-0123456789abcdef"
STEPS = 200
ELASTIC_STEPS = 300


@pytest.fixture(scope="module")
def prefix(bootstrap: str) -> Iterator[tuple[str, TopicNames]]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    yield prefix, names
    delete_topics(bootstrap, list(names.all()))


def drain_node(run_id: str) -> DrainNode:
    """An operator's DrainNode of node-0001 for attempt 0, its boundary within 1 s."""
    reason = Reason(code=ReasonCode.DRAIN, text="operator: its fans")
    return DrainNode(
        command_id=f"drain-{uuid.uuid4().hex[:8]}", run_id=run_id, attempt=0, issued_ts=time.time(),
        reason=reason, node="node-0001", within_s=1.0,
    )  # fmt: skip


def test_a_drained_node_leaves_at_the_agreed_checkpoint_and_warm_spares_take_its_ranks(
    bootstrap: str, prefix: tuple[str, TopicNames], tmp_path: Path
) -> None:
    topic_prefix, names = prefix
    clean = launch(tmp_path / "clean", bootstrap, topic_prefix, SECRET, STEPS)
    assert clean.wait() == 0, clean.explain()
    assert clean.restarts() == []

    run = launch(tmp_path / "drain", bootstrap, topic_prefix, SECRET, STEPS)
    run.until_step(20)
    command = drain_node(run.run_id)
    send(bootstrap, names.commands, SECRET, command)
    acks = acks_of(bootstrap, names, command.command_id)
    # (the spares that join attempt 1 read the topic from its start: they refuse it as stale)
    [ack] = [a for a in acks if a.node == "launcher"]
    assert ack.status is AckStatus.EXECUTED, acks
    assert ack.detail.startswith("node-0001 (ranks 2, 3) drains at attempt 0's next checkpoint boundary")
    assert run.wait() == 0, run.explain()

    drain = assert_drained_at_the_boundary(run, "node-0001", [2, 3])
    assert drain["command_id"] == command.command_id
    assert drain["restart_s"] < 5.0, drain  # the boundary to every rank's first step
    assert drain["restore_from"] in ({"own": 2, "peer": 2}, {"storage": 4}), drain  # memory, or all storage
    # The console's story: the drain asked, then the closing line of the interruption.
    assert "draining node-0001: attempt 0's ranks leave at their next checkpoint boundary" in run.err
    boundary = drain["resumed_from_step"]
    assert f"interruption 0: drain (node-0001 drained at the checkpoint of step {boundary}:" in run.err
    weights, optimizer = run.final()
    clean_weights, clean_optimizer = clean.final()
    assert_same_tensors(clean_weights, weights)
    assert_same_tensors(clean_optimizer, optimizer)


def test_with_no_spare_ready_a_drain_shrinks_the_world_and_it_grows_back(
    bootstrap: str, prefix: tuple[str, TopicNames], tmp_path: Path
) -> None:
    """Elastic training (--min-nproc 2, no warm spare), docs/examples/train_elastic.py:
    node-0001 drained 1 s after the command; ranks 0 and 1 go on at world 2 from exactly
    that step in their processes (their own memory copies); the processes started for ranks
    2 and 3 become ready and the world grows back to 4 at step 250's checkpoint at the latest
    (TRAIN_GROW_AT: the smaller world waits there for the resize) on spare-0000. Every sample
    of every epoch is trained once; the weights are within 1e-6 of an uninterrupted run's
    (the shards' gradients summed in another order at world 2)."""
    topic_prefix, names = prefix
    runs = {}
    for name in ("clean", "drain"):
        env = {"TRAIN_SAMPLES_FILE": str(tmp_path / name / "samples.jsonl"), "TRAIN_GROW_AT": "250"}
        env["TRAINGUARD_GROW_WITHIN_S"] = "0"  # the grow-back at the first step after the ask
        runs[name] = run = launch(
            tmp_path / name,
            bootstrap,
            topic_prefix,
            SECRET,
            ELASTIC_STEPS,
            env,
            ("--min-nproc", "2"),
            ELASTIC,
        )
        if name == "drain":
            run.until_step(20)
            send(bootstrap, names.commands, SECRET, drain_node(run.run_id))
        assert run.wait() == 0, run.explain()
    clean, run = runs["clean"], runs["drain"]
    assert clean.restarts() == []

    drain, grow = run.restarts()
    assert (drain["cause"], drain["node"], drain["decision"], drain["world_size"]) == (
        "drain", "node-0001", "shrink", 2,
    ), drain  # fmt: skip
    assert drain["decision_reason"].startswith("node-0001 drained and too few warm spares ready"), drain
    boundary = drain["resumed_from_step"]
    assert f"drained at the checkpoint of step {boundary}:" in drain["detail"], drain
    assert all(run.progress(0, r) == boundary for r in range(4)), "a rank trained past the boundary"
    assert drain["restore_from"] == {"own": 2} and drain["new_ranks"] == drain["warm_ranks"] == [], drain
    assert (grow["cause"], grow["decision"], grow["world_size"]) == ("resize", "grow", 4), grow
    # at step 250 at the latest (the smaller world waits there); sooner when the new processes
    # were ready before it (forked from the fork server, they may be)
    assert boundary < grow["resumed_from_step"] <= 250, grow
    assert run.quarantined() == ["node-0001"]
    assert run.nodes() == {0: ["node-0000", "node-0001"], 1: ["node-0000"], 2: ["node-0000", "spare-0000"]}
    pids = run.pids()
    assert [pids[2][r] for r in (0, 1)] == [pids[1][r] for r in (0, 1)] == [pids[0][r] for r in (0, 1)]

    steps = trained(run.workdir / "samples.jsonl")
    assert_each_sample_once(steps, ELASTIC_STEPS, 2048, 64)
    assert_like_clean(steps, trained(clean.workdir / "samples.jsonl"))
    weights, clean_weights = run.final()[0], clean.final()[0]
    for name, value in clean_weights.items():
        assert torch.allclose(weights[name], value, rtol=0, atol=1e-6), name
