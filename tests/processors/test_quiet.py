"""A quiet heartbeat folded without the core's dispatcher (processors/core/quiet.py)
leaves exactly the state ``step`` leaves, and makes no output, heartbeat by heartbeat
along a simulated run that trains and then hangs; anything it does not call quiet it
leaves untouched, for ``step``."""

from __future__ import annotations

import copy

from trainguard.processors.core import CorePolicy, step
from trainguard.processors.core.quiet import fold_quiet_heartbeat
from trainguard.processors.core.state import state_key
from trainguard.processors.driver import CoreDriver
from trainguard.producers.rank.shipper import pack
from trainguard.producers.simulator.cluster import SimulatedCluster
from trainguard.producers.simulator.scenario import Scenario
from trainguard.schemas import Heartbeat

from ..schemas.test_columnar import same

SECRET = b"quiet-test-secret-0123456789abcdef"
#: Heartbeats checked both ways per run (each check copies the core's state twice).
CHECKS = 150


def test_a_quiet_heartbeat_leaves_the_state_step_leaves() -> None:
    scenario = Scenario.builtin("hang-allreduce")  # steady steps, then every rank's stall
    policy = CorePolicy(dedupe_window=4096)  # a small window: the copies stay cheap
    cluster = SimulatedCluster(scenario, 1_000.0, run_id="quiet-run", id_prefix="sim")
    driver = CoreDriver(policy, SECRET)
    heartbeats = scenario.world_size * scenario.steps // 4  # about how many the run sends
    every = max(1, heartbeats // CHECKS)
    seen = quiet = loud = 0
    seq, t = 0, 1_000.0
    while not cluster.done:
        t += 1.0
        for record in pack(cluster.advance(t), "quiet-run", scenario.world_size, 4096, "p", seq, True):
            seq = record.seq + 1
            decoded = driver.decode(record.value)
            header = decoded.header
            assert header is not None
            hint, shard = header.world_size, header.shard
            for part in decoded.parts:
                if not isinstance(part, Heartbeat):
                    continue
                seen += 1
                if seen % every:
                    continue
                key = state_key(part.run_id, shard)
                mine, theirs = copy.deepcopy(driver.state), copy.deepcopy(driver.state)
                if fold_quiet_heartbeat(mine.runs.get(key), part, policy, hint):
                    _, outputs = step(theirs, part, policy, hint, shard, header.shard_ranks)
                    assert outputs == [], part
                    same(mine, theirs, f"after {part.event_id}")
                    quiet += 1
                else:  # not quiet: untouched, for step
                    same(mine, driver.state, f"refused {part.event_id}")
                    loud += 1
            driver.fold(decoded)
    assert quiet > CHECKS // 2 and loud > 0, (quiet, loud)
