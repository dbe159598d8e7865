"""DrainNode end to end through the launcher (issue 46): a real signed command through
Kafka to a real `trainguard launch --restart in-process --warm-spares 2` of
docs/examples/train_tiny.py (four gloo ranks on node-0000 and node-0001, two a node),
no processor: the command is the operator's.

node-0001 is drained with within_s 1 s (the example checkpoints only when asked, so the
deadline, carried to the ranks in the resize key, is the boundary): ranks 2 and 3 leave
with the others at the step they agree on, after its checkpoint is validated; two warm
spares take them on spare-0000, ranks 0 and 1 stay in their processes, the next attempt
resumes from exactly that step, node-0001 is quarantined, and the final weights and
optimizer state are bitwise those of an uninterrupted run."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names
from trainguard.schemas import AckStatus, DrainNode, Reason, ReasonCode

from .drain_runs import assert_drained_at_the_boundary, assert_same_tensors, launch, send
from .test_launcher_restart import acks_of

pytestmark = pytest.mark.broker

SECRET = "drain-broker-test-secret-0123456789abcdef"
STEPS = 200


@pytest.fixture(scope="module")
def prefix(bootstrap: str) -> Iterator[tuple[str, TopicNames]]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    yield prefix, names
    delete_topics(bootstrap, list(names.all()))


def test_a_drained_node_leaves_at_the_agreed_checkpoint_and_warm_spares_take_its_ranks(
    bootstrap: str, prefix: tuple[str, TopicNames], tmp_path: Path
) -> None:
    topic_prefix, names = prefix
    clean = launch(tmp_path / "clean", bootstrap, topic_prefix, SECRET, STEPS)
    assert clean.wait() == 0, clean.explain()
    assert clean.restarts() == []

    run = launch(tmp_path / "drain", bootstrap, topic_prefix, SECRET, STEPS)
    run.until_step(20)
    command = DrainNode(
        command_id=f"drain-{uuid.uuid4().hex[:8]}", run_id=run.run_id, attempt=0, issued_ts=time.time(),
        reason=Reason(code=ReasonCode.DRAIN, text="operator: its fans"), node="node-0001", within_s=1.0,
    )  # fmt: skip
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
