"""The run API of a real processor (its own process, `trainguard process --api-port`) on a
real broker: a short run with a crash and a restart is fed through the telemetry topic,
every endpoint is called over HTTP, and the commands the API accepts are on the commands
topic, signed with the run's key."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from harness.devtools.stack import start_processor
from harness.streams import Job
from trainguard.kafka.topics import TopicNames, delete_topics, ensure_topics, topic_names
from trainguard.processors.core.policy import load_policy
from trainguard.replay.log import read_recording
from trainguard.replay.replay import compare, decisions_of, replay, replayed_decisions
from trainguard.schemas import (
    CheckpointNow,
    Command,
    ReasonCode,
    ResumeFrom,
    auth,
    decode,
    encode,
    encode_batch,
)
from trainguard.schemas.codec import COMMANDS

from ..pipeline import free_port
from ..readers import TopicReader

pytestmark = pytest.mark.broker

SECRET = b"api-broker-test-secret-0123456789"
TOKEN = "api-broker-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLICY = Path(__file__).parents[2] / "processors" / "policies" / "demo.yaml"


@dataclass
class Live:
    bootstrap: str
    names: TopicNames
    url: str
    run_id: str
    fresh_id: str

    def call(
        self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, dict[str, str]]:
        data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers=AUTH if headers is None else headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null"), dict(response.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null"), dict(exc.headers)


def produce(bootstrap: str, topic: str, events: list) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for seq, start in enumerate(range(0, len(events), 50)):
        chunk = events[start : start + 50]
        run_id = chunk[0].run_id
        header = dict(run_id=run_id, node="node-000", world_size=4, producer_id="api-test", seq=seq)
        producer.produce(topic, key=run_id.encode(), value=encode_batch(header, [encode(e) for e in chunk]))
    assert producer.flush(10) == 0


@pytest.fixture(scope="module")
def live(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    ensure_topics(bootstrap, prefix=prefix)
    names = topic_names(prefix)
    log = tmp_path_factory.mktemp("processor") / "processor.log"
    api_port = free_port()
    env = {"TRAINGUARD_SECRET": SECRET.decode(), "TRAINGUARD_API_TOKEN": TOKEN}
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, _ = start_processor(bootstrap, POLICY, free_port(), log, env, prefix, api_port=api_port)
        live = Live(bootstrap, names, f"http://127.0.0.1:{api_port}", f"api-{uuid.uuid4().hex[:8]}", "")
        deadline = time.monotonic() + 60
        while True:  # the web server starts with the worker, after the metrics server
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if live.call("GET", "/", headers={})[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the run API did not come up"
            time.sleep(0.3)
        # A 4-rank run: validated checkpoints at 10 and 20, rank 1 killed after step 24,
        # restarted from 20; and a run that has not checkpointed yet.
        job = Job(run_id=live.run_id, world_size=4, ranks_per_node=2).start().steps(25)
        job.exit(1, signal=9).abort_all()
        job.restart(resumed_from_step=20, delay_s=30.0).steps(5)
        live.fresh_id = f"fresh-{uuid.uuid4().hex[:8]}"
        fresh = Job(run_id=live.fresh_id, world_size=4, checkpoint_every=0).start().steps(3)
        produce(bootstrap, names.telemetry, job.events)
        produce(bootstrap, names.telemetry, fresh.events)
        yield live
        assert proc.poll() is None, f"the processor died:\n{log.read_text()[-3000:]}"
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        delete_topics(bootstrap, list(names.all()))


def recovered_health(live: Live) -> dict[str, Any]:
    """The run's health once the processor has seen the crash and the restart's first step."""
    deadline = time.monotonic() + 60
    while True:
        status, health, _ = live.call("GET", f"/runs/{live.run_id}/health")
        done = status == 200 and health["interruptions"] and health["interruptions"][0]["restart_seconds"]
        fresh = live.call("GET", f"/runs/{live.fresh_id}/health")[0] == 200
        if done and fresh:
            return dict(health)
        assert time.monotonic() < deadline, (status, health)
        time.sleep(0.3)


def test_every_endpoint_answers_from_the_live_processor_and_bad_requests_get_a_clear_4xx(live: Live) -> None:
    health = recovered_health(live)
    assert health["phase"] == "training" and health["attempt"] == 1 and health["world_size"] == 4
    assert health["step_time_p50"] == pytest.approx(1.0, abs=0.1) and 0 <= health["slowest_rank"] < 4
    (crash,) = health["interruptions"]
    assert (crash["cause"], crash["rank"], crash["node"]) == ("crash", 1, "node-000")
    assert 30.0 < crash["restart_seconds"] < 33.0 and 0 < health["goodput_7d"] < 1
    assert [q["node"] for q in health["quarantined_nodes"]] == ["node-000"]
    assert health["validated_checkpoints"] == [10, 20]

    status, timeline, _ = live.call("GET", f"/runs/{live.run_id}/timeline")
    assert status == 200
    (entry,) = timeline["interruptions"]
    assert entry["interruption_id"] == crash["interruption_id"] and entry["lost_steps"] == 4
    assert entry["gpu_hours"] > 0 and [d["kind"] for d in entry["decisions"]] == [
        "abort",
        "interruption_decided",  # issue 45: a node out and no spare said ready: wait or shrink
        "quarantine",
        "quarantine_node",
    ]
    assert entry["decisions"][1]["reason"].startswith("if no spare is ready:")

    status, document, _ = live.call("GET", "/openapi.json", headers={})
    assert status == 200 and document["openapi"] == "3.1.0"
    for path, operations in document["paths"].items():  # every documented route is served
        for method in operations:
            assert live.call(method.upper(), path.replace("{run_id}", live.fresh_id), b"{}")[0] != 405

    spec = {"name": "llama", "world_size": 8, "checkpoint": {"uri": "/ckpt", "interval": "auto"}}
    status, declared, _ = live.call("POST", "/runs", spec, {**AUTH, "Idempotency-Key": "declare-1"})
    assert status == 202 and declared["run_id"].startswith("llama-") and declared["known"] is False
    assert live.call("GET", f"/runs/{declared['run_id']}/health")[0] == 404  # until its launcher starts it

    checks: list[tuple[str, str, object, dict[str, str], int, str]] = [
        ("GET", f"/runs/{live.run_id}/health", None, {}, 401, "missing credentials"),
        (
            "GET",
            f"/runs/{live.run_id}/timeline",
            None,
            {"Authorization": "Bearer wrong"},
            401,
            "wrong API token",
        ),
        ("POST", f"/runs/{live.run_id}/checkpoint", None, {}, 401, "missing credentials"),
        ("GET", "/runs/no-such-run/health", None, AUTH, 404, "no run 'no-such-run'"),
        ("GET", "/no/such/path", None, AUTH, 404, "no such path"),
        ("DELETE", f"/runs/{live.run_id}/health", None, AUTH, 405, "allowed: GET"),
        ("POST", "/runs", b'{"name": "x", ', AUTH, 400, "not valid JSON"),
        ("POST", "/runs", {**spec, "world_size": -1}, AUTH, 422, "world_size: Input should be greater"),
        ("POST", f"/runs/{live.fresh_id}/resume", None, AUTH, 409, "no validated checkpoint"),
    ]
    for method, path, body, headers, want, says in checks:
        status, error, response_headers = live.call(method, path, body, headers)
        assert (status, error["status"]) == (want, want), (method, path, error)
        assert says in error["message"], (method, path, error)
        if want == 401:
            assert response_headers["WWW-Authenticate"].startswith("Bearer")


def test_checkpoint_and_resume_put_signed_commands_on_the_commands_topic(live: Live) -> None:
    recovered_health(live)
    commands = TopicReader(live.bootstrap, live.names.commands)
    try:
        keyed = {**AUTH, "Idempotency-Key": "before-maintenance"}
        status, first, _ = live.call(
            "POST", f"/runs/{live.run_id}/checkpoint", {"reason": "maintenance"}, keyed
        )
        assert status == 202 and first["kind"] == "checkpoint_now" and first["attempt"] == 1
        retry = live.call("POST", f"/runs/{live.run_id}/checkpoint", {"reason": "maintenance"}, keyed)[1]
        assert retry["command_id"] == first["command_id"]  # the actuators execute it once
        status, newest, _ = live.call("POST", f"/runs/{live.run_id}/resume")
        assert status == 202 and (newest["checkpoint_step"], newest["uri"]) == (20, f"mem://{live.run_id}/20")
        named = live.call("POST", f"/runs/{live.run_id}/resume", {"from": 10})[1]
        assert named["checkpoint_step"] == 10
        status, refused, _ = live.call("POST", f"/runs/{live.run_id}/resume", {"from": 15})
        assert status == 422 and refused["fields"][0]["field"] == "from"

        def accepted(seen: list) -> list[Command]:
            """The run's commands of the kinds only the API issues."""
            found = [decode(s.value, COMMANDS) for s in seen]
            kinds = (CheckpointNow, ResumeFrom)
            return [c for c in found if isinstance(c, kinds) and c.run_id == live.run_id]

        got = accepted(commands.until(lambda seen: len(accepted(seen)) >= 4))
        key = auth.run_key(SECRET, live.run_id)
        assert all(auth.verify(c, key) and c.run_id == live.run_id and c.attempt == 1 for c in got)
        assert not any(auth.verify(c, auth.run_key(SECRET, live.fresh_id)) for c in got)
        checkpoints = [c for c in got if isinstance(c, CheckpointNow)]
        assert len(checkpoints) == 2 and checkpoints[0] == checkpoints[1]  # the retry: the same command
        assert checkpoints[0].command_id == first["command_id"]
        assert "maintenance" in checkpoints[0].reason.text
        resumes = sorted((c for c in got if isinstance(c, ResumeFrom)), key=lambda c: c.checkpoint_step)
        assert [(c.checkpoint_step, c.uri) for c in resumes] == [
            (s, f"mem://{live.run_id}/{s}") for s in (10, 20)
        ]
        assert [c.command_id for c in resumes] == [named["command_id"], newest["command_id"]]
        assert len(accepted(commands.settle())) == 4  # nothing for the refused request
    finally:
        commands.close()

    # The operator's commands are the run's inputs: its replay still reproduces the processor.
    recording = read_recording(live.bootstrap, live.names, live.run_id)
    assert {c.command_id for c in recording.operator_commands} == (
        {first["command_id"], named["command_id"], newest["command_id"]}
    )  # the retried checkpoint is in the log twice, with one id
    assert not any(c.reason.code == ReasonCode.OPERATOR for c in recording.commands)
    comparison = compare(
        decisions_of(recording), replayed_decisions(replay(recording, load_policy(str(POLICY))))
    )
    assert comparison.identical and comparison.recorded > 0, comparison.differences
