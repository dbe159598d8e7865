"""The policy settings the core reads. One frozen, typed object; every field documented.

The numbers are the seed's (§3 `step_timeout: "90s"`; §7's watchdog: "3x p99 step
time, ~90 s"). `trainguard policy show` prints them all; `trainguard policy check FILE`
validates a policy file.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .accounting.baseline_state import BaselinePolicy
from .accounting.goodput import GoodputPolicy
from .accounting.retention import RetentionPolicy
from .decisions.capacity_state import ElasticPolicy
from .decisions.eviction_state import EvictionPolicy
from .decisions.interval import IntervalPolicy
from .decisions.paging_state import PagingPolicy
from .detectors.diagnosis_state import DiagnosisPolicy
from .detectors.group_state import GroupSlowdownPolicy
from .detectors.hazard_state import PredictionPolicy
from .detectors.sdc_state import SdcPolicy
from .detectors.slowdown_state import SlowdownPolicy
from .detectors.straggler_state import StragglerPolicy


class HangPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    p99_multiplier: float = Field(3.0, gt=1, description="step_timeout = multiplier x p99 step time.")
    default_timeout_s: float = Field(
        90.0, gt=0, description="Used until min_samples step times have been seen (seed §3)."
    )
    min_samples: int = Field(50, ge=1, description="Step times needed before the p99 is trusted.")
    window: int = Field(2000, ge=10, description="How many recent step times the p99 is taken over.")
    floor_s: float = Field(10.0, gt=0, description="Never time out faster than this.")
    ceiling_s: float = Field(1800.0, gt=0, description="Never wait longer than this.")
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Allowed from a rank's first sign of life to its first step of an attempt."
    )
    stack_collect_s: float = Field(
        30.0,
        gt=0,
        description="After an abort, how long to wait for every rank's stack dump, from the first "
        "answer or tick after it (processors/core/detectors/stack_window.py); an odd stack that no missing "
        "dump could change ends the wait sooner.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> HangPolicy:
        if self.floor_s > self.ceiling_s:
            raise ValueError(f"floor_s ({self.floor_s}) must not exceed ceiling_s ({self.ceiling_s})")
        return self


class CrashPolicy(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_loss_window_s: float = Field(
        10.0,
        gt=0,
        description="After the first exit of a rank that died of a lost peer, how long to wait for "
        "the culprit's own exit before naming the hosts none of whose ranks reported one (a whole "
        "host lost); the next attempt's start ends the wait sooner (processors/core/detectors/peer_loss.py).",
    )


#: The policy file format this code reads.
POLICY_VERSION = 1


class CorePolicy(BaseModel):
    """Every threshold of the core, defaults from the seed. A policy file is this object
    in YAML: `version`, then any subset of the sections (omitted fields keep defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = Field(POLICY_VERSION, description="Policy file format version.")
    hang: HangPolicy = HangPolicy()
    crash: CrashPolicy = CrashPolicy()
    baseline: BaselinePolicy = BaselinePolicy()
    sdc: SdcPolicy = SdcPolicy()
    straggler: StragglerPolicy = StragglerPolicy()
    diagnosis: DiagnosisPolicy = DiagnosisPolicy()
    group_slowdown: GroupSlowdownPolicy = GroupSlowdownPolicy()
    #: A node or a rank persistently a few percent slow, over windows (issue 47, detectors/slowdown.py).
    slowdown: SlowdownPolicy = SlowdownPolicy()
    interval: IntervalPolicy = IntervalPolicy()
    paging: PagingPolicy = PagingPolicy()
    goodput: GoodputPolicy = GoodputPolicy()
    retention: RetentionPolicy = RetentionPolicy()
    eviction: EvictionPolicy = EvictionPolicy()
    elastic: ElasticPolicy = ElasticPolicy()
    prediction: PredictionPolicy = PredictionPolicy()
    rollback_on_sdc: bool = Field(
        True,
        description="On an SDC mismatch, roll back to the clean ancestor (R6); false: quarantine "
        "and report only, and leave the rollback to a human.",
    )
    release_on_self_test_pass: bool = Field(
        False,
        description="A quarantined node that passes its node self-test returns to the pool; "
        "false: it stays out (the pass is recorded) until a human releases it. A node that "
        "fails stays out either way.",
    )
    dedupe_window: int = Field(
        200_000, ge=1000, description="Event ids remembered per run to drop redelivered events."
    )

    @field_validator("version")
    @classmethod
    def _known_version(cls, version: int) -> int:
        if version != POLICY_VERSION:
            raise ValueError(
                f"policy format {version} is not the one this trainguard reads ({POLICY_VERSION})"
            )
        return version


class PolicyError(ValueError):
    """A policy file that cannot be used; `problems` are 'field.path: reason' lines."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"invalid policy {source}:\n" + "\n".join(f"  {p}" for p in problems))
        self.source = source
        self.problems = problems


def parse_policy(data: object, source: str = "<policy>") -> CorePolicy:
    """Validate a parsed policy document; PolicyError lists every bad field with its reason."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(source, [f"<root>: expected a mapping of sections, got {type(data).__name__}"])
    try:
        return CorePolicy.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}"
            + (
                f" (got {e['input']!r})"
                if e["type"] != "extra_forbidden" and not isinstance(e["input"], dict)
                else ""
            )
            for e in exc.errors(include_url=False)
        ]
        raise PolicyError(source, problems) from None


def load_policy(path: str | None) -> CorePolicy:
    """The policy from a YAML file (defaults for every field it omits); None -> defaults.
    Raises PolicyError naming each invalid field and the reason."""
    if path is None:
        return CorePolicy()
    import yaml

    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise PolicyError(path, [f"<file>: not valid YAML: {exc}"]) from None
    return parse_policy(data, path)


def dump_policy(policy: CorePolicy) -> str:
    """The whole effective policy as YAML (every field, defaults included)."""
    import yaml

    return str(yaml.safe_dump(policy.model_dump(mode="json"), sort_keys=False))
