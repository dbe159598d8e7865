"""The run API (seed §3), as pure functions: a request and the processor's state in, a
status, a JSON body and the commands to publish out. No socket, no clock, no randomness
(the web glue in :mod:`.api_web` passes a fresh `request_id` and publishes the commands).

Endpoints (every one but ``GET /`` and ``GET /openapi.json`` needs ``Authorization:
Bearer <token>``; :data:`ROUTES` is the one table the server and the OpenAPI document
are both built from):

  POST /runs                   validate a run spec, allocate its run_id (202)
  GET  /runs/{id}/health       step times, slowest rank, goodput, interruptions, quarantined
                               nodes, SDC checks, from the live core state
  POST /runs/{id}/checkpoint   publish a signed CheckpointNow for the current attempt (202)
  POST /runs/{id}/resume       publish a signed ResumeFrom a *validated* checkpoint, the newest
                               one by default (202); 409 when there is none, 422 when the
                               named step is not one
  GET  /runs/{id}/timeline     every interruption: cause, node, rank, lost steps, restart
                               seconds, cost, the decisions it caused and their reasons

One file on purpose: every endpoint's handler sits next to the route table that the
server and the OpenAPI document are both built from; the models, the view and the web
glue are modules of their own (api_models, api_view, api_openapi, api_web).

What registering a run means. The log is the only source of truth: a run exists for the
core when its launcher's RunStarted arrives, and a replay of the log must rebuild the same
state. So ``POST /runs`` writes nothing and keeps nothing: it validates the spec, derives a
run_id (from the Idempotency-Key when given, so a retried POST gets the same id), a config
digest, the `trainguard launch` command line that starts it, and says where the spec
differs from this processor's policy (the core applies one policy to every run). An
API-side registry would be state that the log does not have, lost on restart and
invisible to replay; a RunDeclared event would need a new schema kind and a core that
acted on it. Until the launcher starts it, ``GET /runs/{id}/health`` answers 404.

Read-only snapshot. The handlers read the core's state (never write it; the core is only
driven by events) between two records of the stream: the processor folds a record
synchronously on the event loop the server shares, so a request never sees a record half
applied. The goodput is summed from the core's minute buckets without touching its
window cursors.

The timeline needs what the core emits but does not keep (an interruption's cause,
lost steps, restart seconds, cost and the decisions it led to): :class:`RunsView` is a
projection folded from the processor's own outputs, the same derived events and commands
it publishes, in the order it publishes them; deterministic, bounded, and rebuilt
exactly as the core is. It mirrors the archive's ``timeline`` view (sinks/archive_schema.py):
a decision belongs to an interruption when it shares a cause with it, or was caused by a
decision that does (the quarantine's QuarantineNode).

Commands the API publishes are signed with the run's key like the core's, for the run's
current attempt, stamped with the run's event time (its newest event's ts). Their
command_id is uuid5 of (kind, run_id, Idempotency-Key) when the client sends the header,
so a retried POST yields the same id and the actuators execute it once; without it, each
request is a new command.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ValidationError

from ..common.checkpoint_location import checkpoint_location
from ..schemas import (
    CheckpointNow,
    Command,
    Reason,
    ReasonCode,
    ResumeFrom,
)
from ..schemas.auth import run_key, sign
from .api_models import (
    ApiError,
    CheckpointRequest,
    CommandAccepted,
    DecisionOut,
    FieldError,
    Health,
    InterruptionSummary,
    QuarantinedNode,
    ResumeRequest,
    RunDeclared,
    RunSpec,
    SdcChecks,
    SdcResult,
    Status,
    Timeline,
    TimelineEntry,
    _Body,
)
from .api_openapi import build_openapi
from .api_view import (
    RunsView,
    RunView,
)
from .core import CorePolicy, CoreState, RunPhase, RunState, step_time_summary
from .core.accounting.goodput import Breakdown, GoodputState, Minute

API_VERSION = "1.0.0"
WEEK_S = 604_800.0
_NAMESPACE = uuid.UUID("0b8f4c1e-6a53-4c49-9d0e-617069747267")
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ApiRequest:
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes = b""
    #: A fresh unique id per request (from the glue): the command id when no
    #: Idempotency-Key is sent.
    request_id: str = ""

    @classmethod
    def make(
        cls, method: str, path: str, headers: Mapping[str, str], body: bytes = b"", request_id: str = ""
    ) -> ApiRequest:
        lowered = {k.lower(): v for k, v in headers.items()}
        return cls(method.upper(), path, lowered, body, request_id)


@dataclass(frozen=True)
class ApiResponse:
    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Signed commands the glue must publish (delivered) before answering.
    commands: tuple[Command, ...] = ()


@dataclass(frozen=True)
class ApiContext:
    """What the handlers read: the live core state, the projection, the policy in force,
    and the secrets (the API token; the master secret the commands are signed with)."""

    state: CoreState
    view: RunsView
    policy: CorePolicy
    token: str = field(repr=False)
    master_secret: bytes = field(repr=False)


Handler = Callable[[ApiContext, ApiRequest, dict[str, str], Any], ApiResponse]


def error(
    status: int, code: str, message: str, fields: Iterable[FieldError] = (), **headers: str
) -> ApiResponse:
    body = ApiError(status=status, error=code, message=message, fields=list(fields))
    return ApiResponse(
        status, body.model_dump(mode="json"), {k.replace("_", "-"): v for k, v in headers.items()}
    )


def _ok(status: int, model: BaseModel, commands: tuple[Command, ...] = ()) -> ApiResponse:
    return ApiResponse(status, model.model_dump(mode="json", by_alias=True), {}, commands)


def _authenticate(token: str, headers: Mapping[str, str]) -> ApiResponse | None:
    challenge = 'Bearer realm="trainguard"'
    scheme, _, given = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        message = "missing credentials: send 'Authorization: Bearer <token>'"
        return error(401, "unauthorized", message, WWW_Authenticate=challenge)
    if not hmac.compare_digest(given.strip().encode(), token.encode()):  # constant time
        return error(401, "unauthorized", "wrong API token", WWW_Authenticate=challenge)
    return None


def _parse(model: type[_Body], raw: bytes, required: bool) -> _Body | ApiResponse:
    if not raw.strip():
        if required:
            return error(400, "malformed_json", "a JSON object body is required")
        return model()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return error(400, "malformed_json", f"the body is not valid JSON: {exc}")
    if not isinstance(data, dict):
        return _invalid("<body>", f"expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [
            FieldError(
                field=".".join(map(str, e["loc"])) or "<body>",
                reason=e["msg"].removeprefix("Value error, "),
            )
            for e in exc.errors(include_url=False)
        ]
        listed = "; ".join(f"{p.field}: {p.reason}" for p in problems)
        return error(422, "invalid_field", f"invalid request body: {listed}", problems)


def _invalid(name: str, reason: str) -> ApiResponse:
    message = f"invalid request body: {name}: {reason}"
    return error(422, "invalid_field", message, [FieldError(field=name, reason=reason)])


def _run(ctx: ApiContext, run_id: str) -> RunState | ApiResponse:
    run = ctx.state.runs.get(run_id)
    if run is None or not run.coordinator:  # shards of a sharded run are keyed "id#n"
        message = (
            f"no run {run_id!r} on this processor: it has seen no telemetry of it (a declared run "
            "exists once its launcher starts it; a run whose partitions another worker owns is there)"
        )
        return error(404, "not_found", message)
    return run


def _idempotency_key(request: ApiRequest) -> str | None | ApiResponse:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.match(key):
        return error(400, "invalid_header", "Idempotency-Key must be 1-255 visible ASCII characters")
    return key


def _derived_uuid(*parts: str) -> str:
    return uuid.uuid5(_NAMESPACE, orjson.dumps(parts).decode()).hex  # a JSON list: unambiguous


def command_id(kind: str, run_id: str, idempotency_key: str | None, request_id: str) -> str:
    """uuid5 of (kind, run_id, key): a retried POST is the same command (actuators execute
    a command_id once); without a key, one per request."""
    if idempotency_key is not None:
        return _derived_uuid("api", kind, run_id, idempotency_key)
    return _derived_uuid("api", kind, run_id, "request", request_id)


# --------------------------------------------------------------------------- handlers


def _status(ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: Any) -> ApiResponse:
    return _ok(200, Status())


def _openapi(ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: Any) -> ApiResponse:
    return ApiResponse(200, openapi_document())


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1, from :data:`ROUTES` and the pydantic models (so it cannot drift)."""
    return build_openapi(ROUTES, API_VERSION, _IDEMPOTENCY_KEY.pattern)


def _declare(ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: RunSpec) -> ApiResponse:
    key = _idempotency_key(request)
    if isinstance(key, ApiResponse):
        return key
    # With a key, a retried POST gets the same id; without one, each POST a new id.
    suffix = _derived_uuid("run", key) if key is not None else _derived_uuid("run", request.request_id, "")
    run_id = f"{body.name}-{suffix[:12]}"
    digest = hashlib.sha256(body.model_dump_json().encode()).hexdigest()[:16]
    directory = checkpoint_location(body.checkpoint.uri, need_package=False)
    launch = ["trainguard", "launch", "--run-id", run_id, "--nproc", str(body.world_size)]
    launch += ["--checkpoint-dir", directory, "--", *body.entrypoint]
    known = (run := ctx.state.runs.get(run_id)) is not None and run.coordinator
    declared = RunDeclared(
        run_id=run_id,
        name=body.name,
        world_size=body.world_size,
        config_digest=digest,
        known=known,
        launch=launch,
        checkpoint=body.checkpoint,
        health=body.health,
        policy_differences=policy_differences(body, ctx.policy),
    )
    return _ok(202, declared)


def policy_differences(spec: RunSpec, policy: CorePolicy) -> list[str]:
    found = []
    where = "the core applies one policy to every run: set it in this processor's policy file"
    interval = policy.interval
    applied: str | float = "auto" if interval.mode == "auto" else interval.initial_s
    if spec.checkpoint.interval != applied:
        requested = spec.checkpoint.interval
        found.append(f"checkpoint.interval: requested {requested!r}, applied {applied!r} ({where})")
    if not math.isclose(spec.health.step_timeout, policy.hang.default_timeout_s):
        found.append(
            f"health.step_timeout: requested {spec.health.step_timeout:g}s, applied "
            f"{policy.hang.default_timeout_s:g}s (hang.default_timeout_s; {where})"
        )
    if not math.isclose(spec.health.straggler_sigma, policy.straggler.sigma):
        found.append(
            f"health.straggler_sigma: requested {spec.health.straggler_sigma:g}, applied "
            f"{policy.straggler.sigma:g} (straggler.sigma; {where})"
        )
    return found


def goodput_over(state: GoodputState, window_s: float) -> float:
    """Goodput over the trailing `window_s` of the run's clock, summed from the minute
    buckets: read-only (core.goodput.breakdown moves its window cursors). Over all it keeps
    when its longest reported window is shorter."""
    if state.clock is None:
        return Breakdown(window_s, 0.0, 0.0, 0.0, 0.0, 0.0).goodput
    since = math.ceil((state.clock - window_s) / 60.0) - 1  # as breakdown counts minutes
    inside = Minute()
    for key, bucket in state.minutes.items():
        if key > since:
            inside.add(bucket)
    b = inside
    return Breakdown(window_s, b.elapsed, b.checkpoint, b.lost, b.restart, b.straggler, 0, b.narrow).goodput


def _sdc_checks(run: RunState, view: RunView) -> SdcChecks:
    sdc, mismatch = run.sdc, view.last_mismatch
    last: SdcResult | None = None
    if sdc.last_passing_check_step >= 0:
        last = SdcResult(step=sdc.last_passing_check_step, result="pass")
    if mismatch is not None and (last is None or mismatch.step >= last.step):
        last = SdcResult(
            step=mismatch.step,
            result="mismatch",
            method=mismatch.method,
            node=mismatch.node,
            rank=mismatch.rank,
        )
    status: Literal["none", "pass", "mismatch"] = "pass" if sdc.last_passing_check_step >= 0 else "none"
    if sdc.suspect_since_step is not None:
        status = "mismatch"
    return SdcChecks(
        last=last,
        status=status,
        verified_step=sdc.last_passing_check_step,
        mismatches=sdc.mismatches,
        self_checks_issued=sdc.self_checks_issued,
        cross_checks_issued=sdc.cross_checks_issued,
    )


def _interruption_of(view: RunView, caused_by: tuple[str, ...]) -> str | None:
    return next((view.links[c][0] for c in caused_by if c in view.links), None)


def _health(ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: Any) -> ApiResponse:
    run = _run(ctx, params["run_id"])
    if isinstance(run, ApiResponse):
        return run
    view = ctx.view.runs.get(run.run_id, RunView())
    p50, worst, slowest = step_time_summary(run)
    stepped = slowest >= 0
    interruptions = [
        InterruptionSummary(
            interruption_id=r.event.interruption_id,
            at=r.event.ts,
            cause=r.event.cause.value,
            node=r.event.node,
            rank=r.event.rank,
            step=r.event.step,
            restart_seconds=r.recovered.restart_s if r.recovered else None,
        )
        for r in view.interruptions.values()
    ]
    quarantined = [
        QuarantinedNode(
            node=q.node,
            since=q.since,
            attempt=q.attempt,
            reason=q.reason,
            interruption_id=_interruption_of(view, q.caused_by),
        )
        for q in view.quarantined.values()
    ]
    health = Health(
        run_id=run.run_id,
        phase=run.phase.value,
        attempt=run.attempt,
        world_size=run.world_size,
        step=run.job_step,
        as_of=run.last_ts,
        step_time_p50=p50 if stepped else None,
        step_time_max=worst if stepped else None,
        slowest_rank=slowest if stepped else None,
        goodput_7d=goodput_over(run.goodput, WEEK_S),
        interruptions=interruptions,
        quarantined_nodes=quarantined,
        sdc_checks=_sdc_checks(run, view),
        validated_checkpoints=sorted(run.rollback.validated),
    )
    return _ok(200, health)


def _timeline(ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: Any) -> ApiResponse:
    run = _run(ctx, params["run_id"])
    if isinstance(run, ApiResponse):
        return run
    view = ctx.view.runs.get(run.run_id, RunView())
    entries = []
    for record in sorted(view.interruptions.values(), key=lambda r: (r.event.ts, r.event.interruption_id)):
        i, done = record.event, record.recovered
        decisions = sorted(record.decisions.values(), key=lambda d: (d.at, d.kind, d.decision_id))
        entries.append(
            TimelineEntry(
                interruption_id=i.interruption_id,
                at=i.ts,
                attempt=i.attempt,
                cause=i.cause.value,
                detected_by=i.detected_by,
                node=i.node,
                rank=i.rank,
                step=i.step,
                # the restart's own count where it has one (a checkpoint validated after
                # the crash, or rejected at resume, moves it)
                lost_steps=i.lost_steps if done is None or done.lost_steps is None else done.lost_steps,
                last_checkpoint_step=(
                    i.last_checkpoint_step
                    if done is None or done.resumed_from_step is None
                    else done.resumed_from_step
                ),
                restart_seconds=done.restart_s if done else None,
                resumed_attempt=done.resumed_attempt if done else None,
                lost_seconds=done.lost_s if done else None,
                gpu_hours=done.gpu_hours if done else None,
                phases=dict(done.phases) if done else {},
                reason_code=i.reason.code.value,
                reason=i.reason.text,
                decisions=[
                    DecisionOut(
                        decision_id=d.decision_id,
                        kind=d.kind,
                        at=d.at,
                        reason_code=d.reason_code,
                        reason=d.reason,
                    )
                    for d in decisions
                ],
            )
        )
    return _ok(200, Timeline(run_id=run.run_id, interruptions=entries))


def _operator_reason(what: str, given: str) -> Reason:
    text = f"{what}, requested through the run API: {given or 'no reason given'}"
    return Reason(code=ReasonCode.OPERATOR, text=text)


def _publish(ctx: ApiContext, command: Command, **details: Any) -> ApiResponse:
    """202 with the command signed for its run, to be published by the web glue."""
    signed = sign(command, run_key(ctx.master_secret, command.run_id))
    accepted = CommandAccepted(
        run_id=signed.run_id,
        command_id=signed.command_id,
        kind=signed.KIND,
        attempt=signed.attempt,
        issued_ts=signed.issued_ts,
        **details,
    )
    return _ok(202, accepted, (signed,))


def _checkpoint(
    ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: CheckpointRequest
) -> ApiResponse:
    run = _run(ctx, params["run_id"])
    if isinstance(run, ApiResponse):
        return run
    key = _idempotency_key(request)
    if isinstance(key, ApiResponse):
        return key
    if run.phase in (RunPhase.INTERRUPTED, RunPhase.FINISHED):
        message = f"run {run.run_id} is {run.phase.value} (attempt {run.attempt}): no rank would checkpoint"
        return error(409, "conflict", message)
    command = CheckpointNow(
        command_id=command_id(CheckpointNow.KIND, run.run_id, key, request.request_id),
        run_id=run.run_id,
        attempt=run.attempt,
        ranks=None,
        issued_ts=run.last_ts,
        reason=_operator_reason("checkpoint now", body.reason),
    )
    return _publish(ctx, command)


def _resume(ctx: ApiContext, request: ApiRequest, params: dict[str, str], body: ResumeRequest) -> ApiResponse:
    run = _run(ctx, params["run_id"])
    if isinstance(run, ApiResponse):
        return run
    key = _idempotency_key(request)
    if isinstance(key, ApiResponse):
        return key
    validated = run.rollback.validated
    if not validated:
        message = f"run {run.run_id} has no validated checkpoint (only validated ones are resumable)"
        return error(409, "no_validated_checkpoint", message)
    chosen = max(validated) if body.from_step is None else body.from_step
    if chosen not in validated:
        why = _not_resumable(run, chosen)
        return _invalid(
            "from", f"step {chosen} is not a validated checkpoint ({why}); validated: {sorted(validated)}"
        )
    target = validated[chosen]
    warnings = []
    sdc = run.sdc
    if sdc.suspect_since_step is not None and chosen > sdc.last_passing_check_step:
        warnings.append(
            f"checkpoint {chosen} is newer than the verification watermark (step "
            f"{sdc.last_passing_check_step}) while an SDC mismatch at step {sdc.suspect_since_step} "
            "is unresolved: its weights may be corrupt"
        )
    command = ResumeFrom(
        command_id=command_id(ResumeFrom.KIND, run.run_id, key, request.request_id),
        run_id=run.run_id,
        attempt=run.attempt,
        ranks=None,
        issued_ts=run.last_ts,
        reason=_operator_reason(f"resume from validated checkpoint {chosen}", body.reason),
        checkpoint_step=target.step,
        uri=target.uri,
    )
    return _publish(ctx, command, checkpoint_step=target.step, uri=target.uri, warnings=warnings)


def _not_resumable(run: RunState, step: int) -> str:
    if any(v.step == step for v in run.rollback.pruned):
        return "retention dropped it"
    if any(s == step for _, s in run.goodput.checkpoints):
        return "written but never validated"
    return "the core has no record of it"


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    operation: str
    summary: str
    handler: Handler
    response: type[BaseModel] | None
    status: int = 200
    auth: bool = True
    request: type[_Body] | None = None
    body_required: bool = False
    idempotent_key: bool = False
    errors: tuple[int, ...] = ()
    #: Served by faust's own web layer (its production index), not registered by the glue.
    builtin: bool = False

    def match(self, path: str) -> dict[str, str] | None:
        want, got = self.path.strip("/").split("/"), path.strip("/").split("/")
        if len(want) != len(got):
            return None
        params = {}
        for pattern, part in zip(want, got, strict=True):
            if pattern.startswith("{"):
                if not part:
                    return None
                params[pattern.strip("{}")] = part
            elif pattern != part:
                return None
        return params


_RUN_ERRORS = (401, 404)
ROUTES: tuple[Route, ...] = (
    Route("GET", "/", "status", "Liveness (faust's index page)", _status, Status, auth=False, builtin=True),
    Route("GET", "/openapi.json", "openapi", "This OpenAPI document", _openapi, None, auth=False),
    Route(
        "POST", "/runs", "declare_run", "Validate a run spec and allocate its run_id", _declare, RunDeclared,
        status=202, request=RunSpec, body_required=True, idempotent_key=True, errors=(400, 401, 422),
    ),
    Route(
        "GET", "/runs/{run_id}/health", "run_health", "A run's health from the live core state", _health,
        Health, errors=_RUN_ERRORS,
    ),
    Route(
        "POST", "/runs/{run_id}/checkpoint", "checkpoint_now", "Publish a signed CheckpointNow", _checkpoint,
        CommandAccepted, status=202, request=CheckpointRequest, idempotent_key=True,
        errors=(400, *_RUN_ERRORS, 409, 422, 503),
    ),
    Route(
        "POST", "/runs/{run_id}/resume", "resume_from", "Publish a signed ResumeFrom a validated checkpoint",
        _resume, CommandAccepted, status=202, request=ResumeRequest, idempotent_key=True,
        errors=(400, *_RUN_ERRORS, 409, 422, 503),
    ),
    Route(
        "GET", "/runs/{run_id}/timeline", "run_timeline", "Every interruption: cause, cost, decisions",
        _timeline, Timeline, errors=_RUN_ERRORS,
    ),
)  # fmt: skip


def method_not_allowed(method: str, path: str) -> ApiResponse:
    allowed = ", ".join(sorted({r.method for r in ROUTES if r.match(path) is not None}))
    message = f"{method} is not allowed on {path}; allowed: {allowed}"
    return error(405, "method_not_allowed", message, Allow=allowed)


def handle(ctx: ApiContext, request: ApiRequest) -> ApiResponse:
    """Route, authenticate, parse and answer one request."""
    matched = [(route, params) for route in ROUTES if (params := route.match(request.path)) is not None]
    if not matched:
        return error(404, "not_found", f"no such path: {request.path} (GET /openapi.json lists them)")
    method = "GET" if request.method == "HEAD" else request.method
    found = next(((r, p) for r, p in matched if r.method == method), None)
    if found is None:
        return method_not_allowed(request.method, request.path)
    route, params = found
    if route.auth and (denied := _authenticate(ctx.token, request.headers)) is not None:
        return denied
    body: _Body | None = None
    if route.request is not None:
        parsed = _parse(route.request, request.body, route.body_required)
        if isinstance(parsed, ApiResponse):
            return parsed
        body = parsed
    return route.handler(ctx, request, params, body)
