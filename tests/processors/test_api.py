"""The run API (processors/api.py) on core states built from realistic event streams, fed
through the same CoreDriver as the live processor; and its web glue (processors/api_web.py)
on faust's aiohttp application, served in-process without a broker."""

from __future__ import annotations

import asyncio
import copy
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import faust
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from harness.streams import Job
from trainguard import cli
from trainguard.processors import api, api_view, api_web
from trainguard.processors.core import CorePolicy, HangPolicy, goodput, step_time_summary
from trainguard.processors.core.detectors.straggler_state import StragglerPolicy
from trainguard.processors.driver import CoreDriver
from trainguard.schemas import (
    CheckpointNow,
    Command,
    Envelope,
    Interruption,
    Record,
    ResumeFrom,
    SdcSelfCheck,
    auth,
    encode,
    encode_batch,
)
from trainguard.sinks.archive_store import Archive
from trainguard.sinks.archive_store import timeline as archive_timeline

SECRET = b"unit-test-master-secret-0123456789"
TOKEN = "unit-test-api-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POLICY = CorePolicy(hang=HangPolicy(min_samples=20, floor_s=2.0, stack_collect_s=10.0))


@dataclass
class World:
    """A processor's state: the core fed batch by batch, the API's projection beside it."""

    driver: CoreDriver = field(default_factory=lambda: CoreDriver(POLICY, SECRET))
    view: api.RunsView = field(default_factory=api.RunsView)
    records: list[Record] = field(default_factory=list)
    seq: int = 0

    def feed(self, events: Iterable[Envelope], batch: int = 40) -> World:
        events = list(events)
        for i in range(0, len(events), batch):
            chunk = events[i : i + batch]
            header = dict(
                run_id=chunk[0].run_id, node="node-000", world_size=8, producer_id="t", seq=self.seq
            )
            self.seq += 1
            result = self.driver.handle(encode_batch(header, [encode(e) for e in chunk]))
            assert not result.rejections, result.rejections
            self.view.observe(result.derived, result.commands)
            self.records += [*chunk, *result.derived, *result.commands]
        return self

    def context(self, policy: CorePolicy = POLICY) -> api.ApiContext:
        return api.ApiContext(self.driver.state, self.view, policy, TOKEN, SECRET)

    def call(
        self,
        method: str,
        path: str,
        body: object = None,
        headers: dict[str, str] | None = None,
        request_id: str = "req-1",
        policy: CorePolicy = POLICY,
    ) -> api.ApiResponse:
        raw = body if isinstance(body, bytes) else b"" if body is None else orjson.dumps(body)
        request = api.ApiRequest.make(method, path, AUTH if headers is None else headers, raw, request_id)
        return api.handle(self.context(policy), request)


def self_check(job: Job, rank: int, step: int, ok: bool) -> SdcSelfCheck:
    digest = "ab" * 8
    return SdcSelfCheck(
        **{**job._env(rank), "step": step},
        microbatch_id=f"mb-{step}-{rank}",
        digest_first=digest,
        digest_second=digest if ok else "cd" * 8,
    )


def build_world() -> World:
    world = World()
    # run-api: a crash (rank 5, node-002), a restart 42 s later, a hang whose odd stack names
    # rank 3 (node-001), a restart; validated checkpoints every 10 steps.
    job = Job(run_id="run-api", world_size=8, ranks_per_node=2).start().steps(25)
    job.exit(5, signal=9).abort_all()
    job.restart(resumed_from_step=20, delay_s=42.0).steps(25).stall(5.0)
    job.abort_all(culprit=3)
    job.restart(resumed_from_step=40, delay_s=30.0).steps(5)
    world.feed(job.events)
    # run-sdc: rank 5 computes a wrong answer at step 88; passing checks at 35 and 62.
    sdc = Job(run_id="run-sdc", world_size=8, ranks_per_node=2).start().steps(100)
    sdc.events += [self_check(sdc, 2, 35, ok=True), self_check(sdc, 7, 62, ok=True)]
    sdc.events.append(self_check(sdc, 5, 88, ok=False))
    world.feed(sdc.events)
    # run-fresh: training, no checkpoint yet. run-down: crashed, no restart yet.
    world.feed(Job(run_id="run-fresh", world_size=4, checkpoint_every=0).start().steps(5).events)
    world.feed(Job(run_id="run-down", world_size=4).start().steps(12).exit(1, signal=9).events)
    done = Job(run_id="run-done", world_size=2, checkpoint_every=0).start().steps(3)
    world.feed(done.exit(0, exit_code=0).exit(1, exit_code=0).events)
    return world


@pytest.fixture(scope="module")
def world() -> World:
    return build_world()


# --------------------------------------------------------------------------- health


def test_health_reads_step_times_goodput_interruptions_and_quarantines_from_the_core(world: World) -> None:
    response = world.call("GET", "/runs/run-api/health")
    assert response.status == 200, response.body
    health = response.body
    run = world.driver.state.runs["run-api"]
    p50, worst, slowest = step_time_summary(run)
    assert (health["step_time_p50"], health["step_time_max"], health["slowest_rank"]) == (p50, worst, slowest)
    assert 0 <= slowest < 8 and p50 > 0
    # The same number the Prometheus gauge shows (on a copy: the core's goodput moves a cursor).
    assert health["goodput_7d"] == pytest.approx(goodput(copy.deepcopy(run)))
    assert health["goodput_7d"] < 0.5  # two restarts of 30-42 s in ~2 minutes of run time
    assert (health["phase"], health["attempt"], health["world_size"]) == ("training", 2, 8)
    assert [(i["cause"], i["rank"], i["node"]) for i in health["interruptions"]] == [
        ("crash", 5, "node-002"),
        ("hang", 3, "node-001"),
    ]
    assert all(i["restart_seconds"] > 25 for i in health["interruptions"])
    ids = [i["interruption_id"] for i in health["interruptions"]]
    quarantined = {q["node"]: q for q in health["quarantined_nodes"]}
    assert set(quarantined) == {"node-002", "node-001"}
    assert [quarantined["node-002"]["interruption_id"], quarantined["node-001"]["interruption_id"]] == ids
    assert "out of the pool" in quarantined["node-002"]["reason"]
    assert health["sdc_checks"] == {
        "last": None,
        "status": "none",
        "verified_step": -1,
        "mismatches": 0,
        "self_checks_issued": 0,
        "cross_checks_issued": 0,
    }
    assert health["validated_checkpoints"] == [10, 20, 30, 40]


def test_health_of_a_run_with_silent_data_corruption_names_the_mismatch_and_its_node(world: World) -> None:
    health = world.call("GET", "/runs/run-sdc/health").body
    assert health["sdc_checks"]["status"] == "mismatch"
    assert health["sdc_checks"]["last"] == {
        "step": 88,
        "result": "mismatch",
        "method": "self_check",
        "node": "node-002",
        "rank": 5,
    }
    assert health["sdc_checks"]["verified_step"] == 62 and health["sdc_checks"]["mismatches"] == 1
    (sdc,) = health["interruptions"]
    assert sdc["cause"] == "sdc" and sdc["restart_seconds"] is None  # not recovered yet
    # The SDC detector quarantines with a command only (no Quarantine event): still listed.
    (node,) = health["quarantined_nodes"]
    assert node["node"] == "node-002" and node["interruption_id"] == sdc["interruption_id"]


def test_a_run_without_steps_has_no_step_times_and_a_run_that_finished_says_so(world: World) -> None:
    world.feed([Job(run_id="run-new", world_size=4).start().events[0]])
    health = world.call("GET", "/runs/run-new/health").body
    assert (health["step_time_p50"], health["slowest_rank"], health["goodput_7d"]) == (None, None, 1.0)
    assert world.call("GET", "/runs/run-done/health").body["phase"] == "finished"


def test_goodput_is_read_without_moving_the_cores_window_cursors(world: World) -> None:
    # A long run: goodput reports have slid the 1 h window; the 7 d one holds everything.
    long = World()
    job = Job(run_id="run-long", world_size=4, step_s=10.0).start().steps(400)
    job.exit(2, signal=9)
    long.feed(job.restart(resumed_from_step=390, delay_s=300.0).steps(30).events, batch=200)
    run = long.driver.state.runs["run-long"]
    assert run.goodput.slid, "reports were made"
    before = pickle.dumps(run.goodput)
    got = long.call("GET", "/runs/run-long/health").body["goodput_7d"]
    assert pickle.dumps(run.goodput) == before
    assert got == pytest.approx(goodput(copy.deepcopy(run)))
    assert 0.5 < got < 0.95  # a 5-minute restart in ~70 minutes
    hour = api.goodput_over(run.goodput, 3600.0)
    assert hour < got  # the restart weighs more in the last hour than over the whole run


# --------------------------------------------------------------------------- timeline


def test_timeline_lists_every_interruption_with_its_cost_and_the_decisions_it_caused(world: World) -> None:
    response = world.call("GET", "/runs/run-api/timeline")
    assert response.status == 200
    crash, hang = response.body["interruptions"]
    assert (crash["cause"], crash["detected_by"], crash["rank"], crash["node"]) == (
        "crash",
        "rank_exit",
        5,
        "node-002",
    )
    assert (crash["lost_steps"], crash["last_checkpoint_step"], crash["attempt"]) == (4, 20, 0)
    assert 42.0 < crash["restart_seconds"] < 45.0 and crash["resumed_attempt"] == 1
    assert crash["reason_code"] == "rank_exited" and "signal 9" in crash["reason"]
    cost_s = crash["phases"]["detect"] + crash["restart_seconds"] + crash["lost_seconds"]
    assert crash["gpu_hours"] == pytest.approx(8 * cost_s / 3600)
    kinds = [d["kind"] for d in crash["decisions"]]
    assert kinds == ["abort", "interruption_decided", "quarantine", "quarantine_node"]
    # issue 45: a node out and no spare said to be ready: what to do if none is (elastic)
    assert crash["decisions"][1]["reason"].startswith("if no spare is ready:")
    assert (hang["cause"], hang["detected_by"], hang["rank"], hang["node"]) == (
        "hang",
        "progress_watchdog",
        3,
        "node-001",
    )
    assert hang["reason_code"] == "odd_stack" and hang["phases"]["detect"] > 3.0  # the stall
    # The abort with stack dump was decided before the interruption was declared.
    kinds = [d["kind"] for d in hang["decisions"]]
    assert kinds == ["abort", "interruption_decided", "quarantine", "quarantine_node"]
    abort = hang["decisions"][0]
    assert abort["at"] < hang["at"] + 1 and abort["reason_code"] == "no_progress"


def test_timeline_is_the_archives_timeline_of_the_same_outputs(world: World, tmp_path: Path) -> None:
    with Archive(tmp_path / "archive") as store:
        store.write(world.records)
    for run_id in ("run-api", "run-sdc", "run-down"):
        rows = archive_timeline(tmp_path / "archive", run_id)
        entries = world.call("GET", f"/runs/{run_id}/timeline").body["interruptions"]
        assert len(entries) == len(rows) >= 1
        for entry, row in zip(entries, rows, strict=True):
            same = (
                "interruption_id",
                "cause",
                "node",
                "rank",
                "lost_steps",
                "last_checkpoint_step",
                "reason",
            )
            assert {k: entry[k] for k in same} == {k: row[k] for k in same}
            assert entry["at"] == pytest.approx(row["at"])
            for mine, theirs in (("restart_seconds", "restart_seconds"), ("gpu_hours", "gpu_hours")):
                assert entry[mine] == (None if row[theirs] is None else pytest.approx(row[theirs]))
            assert [d["kind"] for d in entry["decisions"]] == row["decisions"]
            assert [f"{d['kind']}: {d['reason']}" for d in entry["decisions"]] == row["decision_reasons"]


def test_the_projection_keeps_a_bounded_number_of_interruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_view, "MAX_INTERRUPTIONS", 2)
    world = World()
    job = Job(run_id="run-flaky", world_size=4).start().steps(12)
    for _ in range(3):
        job.exit(1, signal=9).restart(resumed_from_step=10).steps(3)
    world.feed(job.events)
    crashes = [i for i in world.records if isinstance(i, Interruption)]
    run = world.view.runs["run-flaky"]
    assert len(crashes) == 3 and list(run.interruptions) == [c.interruption_id for c in crashes[1:]]
    assert {iid for iid, _ in run.links.values()} == set(run.interruptions)


# --------------------------------------------------------------------------- commands


def test_checkpoint_publishes_a_signed_checkpoint_now_for_the_current_attempt(world: World) -> None:
    key = {**AUTH, "Idempotency-Key": "maintenance-2027-01-15"}
    response = world.call("POST", "/runs/run-api/checkpoint", {"reason": "maintenance"}, headers=key)
    assert response.status == 202, response.body
    (command,) = response.commands
    run = world.driver.state.runs["run-api"]
    assert isinstance(command, CheckpointNow)
    assert (command.run_id, command.attempt, command.ranks, command.issued_ts) == (
        "run-api",
        2,
        None,
        run.last_ts,
    )
    assert auth.verify(command, auth.run_key(SECRET, "run-api"))
    assert not auth.verify(command, auth.run_key(SECRET, "run-sdc"))
    assert command.reason.code.value == "operator" and "maintenance" in command.reason.text
    assert (
        response.body["command_id"]
        == command.command_id
        == api.command_id("checkpoint_now", "run-api", "maintenance-2027-01-15", "")
    )
    # A retry with the key is the same command (actuators execute a command_id once)...
    retry = world.call("POST", "/runs/run-api/checkpoint", headers=key, request_id="req-2")
    assert retry.commands[0].command_id == command.command_id
    # ...a request without one is a new command each time.
    first = world.call("POST", "/runs/run-api/checkpoint", request_id="req-3").commands[0]
    second = world.call("POST", "/runs/run-api/checkpoint", request_id="req-4").commands[0]
    assert len({first.command_id, second.command_id, command.command_id}) == 3


@pytest.mark.parametrize("run_id, phase", [("run-down", "interrupted"), ("run-done", "finished")])
def test_checkpoint_of_a_run_with_no_live_attempt_is_a_conflict(
    world: World, run_id: str, phase: str
) -> None:
    response = world.call("POST", f"/runs/{run_id}/checkpoint")
    assert response.status == 409 and response.commands == ()
    assert phase in response.body["message"]


def test_resume_defaults_to_the_newest_validated_checkpoint_and_takes_a_named_one(world: World) -> None:
    response = world.call("POST", "/runs/run-api/resume", headers={**AUTH, "Idempotency-Key": "k1"})
    assert response.status == 202, response.body
    (command,) = response.commands
    assert isinstance(command, ResumeFrom) and auth.verify(command, auth.run_key(SECRET, "run-api"))
    assert (command.checkpoint_step, command.uri, command.attempt) == (40, "mem://run-api/40", 2)
    assert response.body["checkpoint_step"] == 40 and response.body["warnings"] == []
    named = world.call(
        "POST", "/runs/run-api/resume", {"from": 20}, headers={**AUTH, "Idempotency-Key": "k1"}
    )
    assert named.commands[0].checkpoint_step == 20
    # Same key, another endpoint: not the same command.
    checkpoint = world.call("POST", "/runs/run-api/checkpoint", headers={**AUTH, "Idempotency-Key": "k1"})
    assert checkpoint.commands[0].command_id != command.command_id == named.commands[0].command_id


def test_resume_past_the_verification_watermark_of_a_corrupted_run_warns(world: World) -> None:
    newest = world.call("POST", "/runs/run-sdc/resume").body
    assert newest["checkpoint_step"] == 90 and "watermark (step 62)" in newest["warnings"][0]
    clean = world.call("POST", "/runs/run-sdc/resume", {"from": 60}).body
    assert clean["checkpoint_step"] == 60 and clean["warnings"] == []


def test_resume_without_a_validated_checkpoint_or_from_an_unvalidated_one_is_refused(world: World) -> None:
    none = world.call("POST", "/runs/run-fresh/resume")
    assert none.status == 409 and none.body["error"] == "no_validated_checkpoint" and none.commands == ()
    wrong = world.call("POST", "/runs/run-api/resume", {"from": 25})
    assert wrong.status == 422 and wrong.commands == ()
    (problem,) = wrong.body["fields"]
    assert problem["field"] == "from" and "validated: [10, 20, 30, 40]" in problem["reason"]
    assert "from: step 25 is not a validated checkpoint" in wrong.body["message"]


def test_resume_names_a_checkpoint_that_was_written_but_never_validated() -> None:
    world = World()
    job = Job(run_id="run-slow", world_size=4, checkpoint_every=0).start().steps(10)
    world.feed(job.checkpoint_written(2.0).events)  # step 9 durable, validation pending
    response = world.call("POST", "/runs/run-slow/resume", {"from": 9})
    assert response.status == 409  # no validated checkpoint at all
    job.checkpoint_every, fed = 10, len(job.events)
    world.feed(job.steps(3).events[fed:])  # validated at step 10 (not 9)
    wrong = world.call("POST", "/runs/run-slow/resume", {"from": 9})
    assert wrong.status == 422 and "written but never validated" in wrong.body["message"]


# --------------------------------------------------------------------------- POST /runs

SPEC = {
    "name": "llama-70b",
    "world_size": 1024,
    "image": "registry.example/train:1.2",
    "entrypoint": ["python", "train.py", "--config", "70b.yaml"],
    "checkpoint": {"uri": "file:///ckpt/llama-70b", "interval": "auto"},
    "health": {"step_timeout": "90s", "straggler_sigma": 3},
}


def test_declaring_a_run_allocates_its_id_and_the_launch_command_and_writes_nothing(world: World) -> None:
    before = pickle.dumps(world.driver.state)
    keyed = {**AUTH, "Idempotency-Key": "declare-1"}
    response = world.call("POST", "/runs", SPEC, headers=keyed)
    assert response.status == 202 and response.commands == ()
    body = response.body
    run_id = body["run_id"]
    assert run_id.startswith("llama-70b-") and len(run_id) == len("llama-70b-") + 12
    assert body["known"] is False and body["policy_differences"] == []
    assert body["launch"] == [
        *(
            "trainguard",
            "launch",
            "--run-id",
            run_id,
            "--nproc",
            "1024",
            "--checkpoint-dir",
            "/ckpt/llama-70b",
        ),
        *("--", "python", "train.py", "--config", "70b.yaml"),
    ]
    assert body["health"] == {"step_timeout": 90.0, "straggler_sigma": 3.0}
    assert pickle.dumps(world.driver.state) == before
    # A retried POST gets the same id; another key or no key, another.
    again = world.call("POST", "/runs", SPEC, headers=keyed, request_id="other").body
    assert (again["run_id"], again["config_digest"]) == (run_id, body["config_digest"])
    assert (
        world.call("POST", "/runs", SPEC, headers={**AUTH, "Idempotency-Key": "x"}).body["run_id"] != run_id
    )
    a, b = (world.call("POST", "/runs", SPEC, request_id=r).body["run_id"] for r in ("r1", "r2"))
    assert len({a, b, run_id}) == 3
    changed = world.call("POST", "/runs", {**SPEC, "world_size": 512}, headers=keyed).body
    assert changed["config_digest"] != body["config_digest"]


def test_declaring_a_run_says_where_the_spec_differs_from_the_processors_policy(world: World) -> None:
    spec = {**SPEC, "checkpoint": {"uri": "/ckpt", "interval": "10m"}, "health": {"straggler_sigma": 2.5}}
    differences = world.call("POST", "/runs", spec).body["policy_differences"]
    assert len(differences) == 2
    assert differences[0].startswith("checkpoint.interval: requested 600.0, applied 'auto'")
    assert differences[1].startswith("health.straggler_sigma: requested 2.5, applied 3")
    lenient = POLICY.model_copy(update={"straggler": StragglerPolicy(sigma=2.5)})
    assert len(world.call("POST", "/runs", spec, policy=lenient).body["policy_differences"]) == 1


def test_an_object_store_checkpoint_uri_goes_to_the_launch_line_as_it_is(world: World) -> None:
    """s3://bucket/ckpt once became the launch line's local directory s3:/bucket/ckpt. An
    fsspec URL is kept whole, whether or not its package is installed on the processor's host
    (the launch checks that where the ranks run); what no host could use is refused."""
    for uri in ("s3://bucket/ckpt", "gs://bucket/ckpt", "/mnt/lustre/ckpt"):
        launch = world.call("POST", "/runs", {**SPEC, "checkpoint": {"uri": uri}}).body["launch"]
        assert launch[launch.index("--checkpoint-dir") + 1] == uri
    for uri, reason in [
        ("file://relative/ckpt", "absolute path"),
        ("memory://ckpt", "one process's memory"),
        ("nosuch://bucket/ckpt", "no filesystem is known"),
    ]:
        response = world.call("POST", "/runs", {**SPEC, "checkpoint": {"uri": uri}})
        assert response.status == 422, (uri, response.body)
        (field,) = response.body["fields"]
        assert field["field"] == "checkpoint.uri" and uri in field["reason"], field
        assert reason in field["reason"], field


def test_declaring_a_run_that_the_core_already_knows_says_so(world: World) -> None:
    run_id = world.call("POST", "/runs", SPEC, headers={**AUTH, "Idempotency-Key": "known"}).body["run_id"]
    world.feed(Job(run_id=run_id, world_size=4).start().steps(2).events)
    again = world.call("POST", "/runs", SPEC, headers={**AUTH, "Idempotency-Key": "known"}).body
    assert again["run_id"] == run_id and again["known"] is True


# --------------------------------------------------------------------------- bad requests

AUTHENTICATED = [(r.method, r.path.replace("{run_id}", "run-api")) for r in api.ROUTES if r.auth]


@pytest.mark.parametrize("method, path", AUTHENTICATED)
def test_every_authenticated_route_refuses_a_missing_or_wrong_token(
    world: World, method: str, path: str
) -> None:
    for headers, why in (
        ({}, "missing credentials"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "missing credentials"),
        ({"Authorization": "Bearer"}, "missing credentials"),
        ({"Authorization": f"Bearer {TOKEN}x"}, "wrong API token"),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, "wrong API token"),
    ):
        response = world.call(method, path, b"{not json", headers=headers)  # auth is checked first
        assert response.status == 401 and why in response.body["message"], (headers, response.body)
        assert response.headers["WWW-Authenticate"].startswith("Bearer") and response.commands == ()
    assert world.call(method, path, headers={"authorization": f"bearer {TOKEN}"}).status != 401


def test_the_openapi_document_and_the_status_page_need_no_token(world: World) -> None:
    assert world.call("GET", "/openapi.json", headers={}).status == 200
    assert world.call("GET", "/", headers={}).body == {"status": "OK"}


def test_unknown_runs_and_paths_are_404(world: World) -> None:
    for method, path in (("GET", "/runs/nope/health"), ("GET", "/runs/nope/timeline")):
        response = world.call(method, path)
        assert response.status == 404 and "no run 'nope'" in response.body["message"]
    for method, path in (("POST", "/runs/nope/checkpoint"), ("POST", "/runs/nope/resume")):
        assert world.call(method, path).status == 404
    assert world.call("GET", "/runs/run-api").status == 404
    assert world.call("GET", "/runs/run-api/health/extra").status == 404
    assert world.call("GET", "/runs//health").status == 404


def test_a_wrong_method_is_405_with_the_allowed_ones(world: World) -> None:
    for method, path, allowed in (
        ("DELETE", "/runs/run-api/health", "GET"),
        ("GET", "/runs/run-api/checkpoint", "POST"),
        ("PUT", "/runs", "POST"),
        ("POST", "/openapi.json", "GET"),
    ):
        response = world.call(method, path, headers={})  # before authentication: the route does not exist
        assert response.status == 405 and response.headers["Allow"] == allowed
        assert f"{method} is not allowed on {path}; allowed: {allowed}" == response.body["message"]
    assert world.call("HEAD", "/runs/run-api/health").status == 200


def test_malformed_json_is_400_and_invalid_fields_are_422_each_named(world: World) -> None:
    for path in ("/runs", "/runs/run-api/checkpoint", "/runs/run-api/resume"):
        response = world.call("POST", path, b'{"name": ')
        assert response.status == 400 and response.body["error"] == "malformed_json"
        assert response.body["message"].startswith("the body is not valid JSON")
    empty = world.call("POST", "/runs", b"")
    assert empty.status == 400 and "body is required" in empty.body["message"]
    bad = {
        **SPEC,
        "name": "no spaces",
        "world_size": 0,
        "checkpoint": {"uri": "/c", "interval": "soon"},
        "health": {"straggler_sigma": -1, "step_timeout": "ninety"},
        "priority": "high",
    }
    response = world.call("POST", "/runs", bad)
    assert response.status == 422 and response.body["error"] == "invalid_field"
    fields = {f["field"]: f["reason"] for f in response.body["fields"]}
    assert set(fields) == {
        "name",
        "world_size",
        "checkpoint.interval",
        "health.step_timeout",
        "health.straggler_sigma",
        "priority",
    }
    assert (
        "'auto', positive seconds" in fields["checkpoint.interval"]
        and "'soon'" in fields["checkpoint.interval"]
    )
    assert fields["world_size"] == "Input should be greater than or equal to 1"
    assert fields["priority"] == "Extra inputs are not permitted"
    assert "checkpoint.interval: expected 'auto'" in response.body["message"]
    missing = world.call("POST", "/runs", {"name": "x"}).body["fields"]
    assert {f["field"] for f in missing} == {"world_size", "checkpoint"}
    for body, field_name in (([1, 2], "<body>"), ({"from": -1}, "from"), ({"from": "latest"}, "from")):
        response = world.call("POST", "/runs/run-api/resume", body)
        assert response.status == 422 and response.body["fields"][0]["field"] == field_name
    assert world.call("POST", "/runs/run-api/checkpoint", {"reason": "x" * 501}).status == 422


def test_a_malformed_idempotency_key_is_400(world: World) -> None:
    for path in ("/runs/run-api/checkpoint", "/runs/run-api/resume"):
        response = world.call("POST", path, headers={**AUTH, "Idempotency-Key": "has space"})
        assert response.status == 400 and "Idempotency-Key" in response.body["message"]
    assert world.call("POST", "/runs", SPEC, headers={**AUTH, "Idempotency-Key": "k" * 256}).status == 400


def test_no_request_changes_the_core_state(world: World) -> None:
    before = pickle.dumps(world.driver.state)
    for route in api.ROUTES:
        path = route.path.replace("{run_id}", "run-sdc")
        world.call(route.method, path, SPEC if route.path == "/runs" else None)
    assert pickle.dumps(world.driver.state) == before


# --------------------------------------------------------------------------- OpenAPI


def resolve(document: dict, ref: str) -> dict:
    assert ref.startswith("#/components/schemas/")
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_the_openapi_document_describes_every_route_from_the_models(world: World) -> None:
    document = world.call("GET", "/openapi.json").body
    assert document["openapi"] == "3.1.0"
    described = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert described == {(r.method, r.path) for r in api.ROUTES}
    for route in api.ROUTES:
        operation = document["paths"][route.path][route.method.lower()]
        assert operation["security"] == ([{"bearerAuth": []}] if route.auth else [])
        if route.request is not None:
            schema = resolve(
                document, operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            )
            assert set(schema["properties"]) == {f.alias or n for n, f in route.request.model_fields.items()}
        success = operation["responses"][str(route.status)]["content"]["application/json"]["schema"]
        if route.response is not None:
            assert set(resolve(document, success["$ref"])["properties"]) == set(route.response.model_fields)
        for status in route.errors:
            error_ref = operation["responses"][str(status)]["content"]["application/json"]["schema"]["$ref"]
            assert resolve(document, error_ref)["required"] == ["status", "error", "message"]
    spec = document["components"]["schemas"]["RunSpec"]
    assert set(spec["required"]) == {"name", "world_size", "checkpoint"}
    assert {"const": "auto"} in document["components"]["schemas"]["CheckpointSpec"]["properties"]["interval"][
        "oneOf"
    ]
    assert document["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}


# --------------------------------------------------------------------------- the web glue


def served_app(world: World, publish: api_web.Publish) -> faust.App:
    app = faust.App("test-api", broker="kafka://127.0.0.1:1", **api_web.web_options(8080, "127.0.0.1"))
    api_web.mount(app, world.context(), publish)
    app.web.init_server()  # applies faust's own pages, as the worker does at start
    return app


async def no_publish(command: Command) -> None:
    raise AssertionError("nothing to publish")


def test_every_route_served_is_in_the_document_and_every_one_documented_is_served(world: World) -> None:
    published: list[Command] = []

    async def publish(command: Command) -> None:
        published.append(command)

    app = served_app(world, publish)
    served = {(r.method, r.resource.canonical) for r in app.web.web_app.router.routes() if r.resource}
    document = api.openapi_document()
    assert {path for _, path in served} == set(document["paths"])
    documented = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert documented <= served

    async def probe() -> None:
        async with TestClient(TestServer(app.web.web_app)) as client:
            for method, path in sorted(served | {("OPTIONS", p) for _, p in served}):
                url = path.replace("{run_id}", "run-fresh")
                body = orjson.dumps(SPEC) if path == "/runs" else b""
                response = await client.request(method, url, headers=AUTH, data=body)
                allowed = (method if method != "HEAD" else "GET", path) in documented
                assert (response.status != 405) is allowed, (method, path, response.status)
                if method != "HEAD":
                    assert "application/json" in response.headers["Content-Type"]
                    if not allowed:
                        assert (await response.json())["error"] == "method_not_allowed"

    asyncio.run(probe())
    assert [c.KIND for c in published] == ["checkpoint_now"]  # run-fresh has nothing to resume from


def test_the_web_glue_publishes_a_command_before_answering_and_503_when_it_cannot(world: World) -> None:
    published: list[Command] = []

    async def publish(command: Command) -> None:
        published.append(command)

    async def broken(command: Command) -> None:
        raise ConnectionError("broker down")

    async def requests() -> None:
        async with TestClient(TestServer(served_app(world, publish).web.web_app)) as client:
            response = await client.post("/runs/run-api/checkpoint", headers=AUTH)
            assert response.status == 202
            assert [c.command_id for c in published] == [(await response.json())["command_id"]]
            assert (await client.get("/runs/run-api/health")).status == 401
            assert (await client.get("/nowhere", headers=AUTH)).status == 404
            too_big = await client.post("/runs", headers=AUTH, data=b" " * (api_web.MAX_BODY_BYTES + 1))
            assert too_big.status == 413 and (await too_big.json())["error"] == "too_large"
        async with TestClient(TestServer(served_app(world, broken).web.web_app)) as client:
            response = await client.post("/runs/run-api/resume", headers=AUTH)
            assert response.status == 503
            assert "could not be published" in (await response.json())["message"]

    asyncio.run(requests())


def test_the_token_comes_from_the_environment_or_a_file_and_is_required(tmp_path: Path) -> None:
    assert api_web.load_api_token({"TRAINGUARD_API_TOKEN": TOKEN}) == TOKEN
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")
    assert api_web.load_api_token({"TRAINGUARD_API_TOKEN_FILE": str(path)}) == TOKEN
    with pytest.raises(api_web.ApiTokenError, match="set TRAINGUARD_API_TOKEN"):
        api_web.load_api_token({})
    with pytest.raises(api_web.ApiTokenError, match="cannot read"):
        api_web.load_api_token({"TRAINGUARD_API_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(api_web.ApiTokenError, match="shorter than 16"):
        api_web.load_api_token({"TRAINGUARD_API_TOKEN": "short"})
    # The processor refuses to start the API without one, before it touches the broker.
    env = {"TRAINGUARD_API_TOKEN": "", "TRAINGUARD_API_TOKEN_FILE": "", "TRAINGUARD_SECRET": SECRET.decode()}
    args = ["process", "--bootstrap", "127.0.0.1:1", "--api-port", "8999"]
    result = CliRunner().invoke(cli.app, args, env=env)
    assert result.exit_code == 2 and "the run API needs a token" in " ".join(result.output.split())
    app = faust.App("test-api-token", broker="kafka://127.0.0.1:1", **api_web.web_options(8080, "127.0.0.1"))
    context = api.ApiContext(World().driver.state, api.RunsView(), POLICY, "", SECRET)
    with pytest.raises(api_web.ApiTokenError):
        api_web.mount(app, context, no_publish)


def test_a_released_node_leaves_the_quarantined_list() -> None:
    from trainguard.processors.core import run_all
    from trainguard.schemas import Command, Derived

    # A bad batch at step 125: node-001 is quarantined at the first failure, then released
    # when the step fails on node-002 too (data or code).
    job = Job(step_s=60.0, checkpoint_every=10).start().steps(126)
    job.exit(5, exit_code=1)
    job.replace("node-001")
    job.restart(resumed_from_step=120).steps(5)
    job.exit(9, exit_code=1)
    _, outputs = run_all(job.events, CorePolicy())
    derived = [o for o in outputs if isinstance(o, Derived)]
    commands = [o for o in outputs if isinstance(o, Command)]
    first = next(i for i, o in enumerate(derived) if o.KIND == "quarantine") + 1
    view = api_view.RunsView()
    view.observe(derived[:first], [c for c in commands if c.KIND == "quarantine_node"])
    assert list(view.runs["run-test"].quarantined) == ["node-001"]
    view.observe(derived[first:], [c for c in commands if c.KIND != "quarantine_node"])
    assert view.runs["run-test"].quarantined == {}
