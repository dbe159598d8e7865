"""The ring cross-rank check on the rank side (producers/ring_check.py), without a broker:
the handler, the value each rank reports, the step agreement, and that a check leaves
training bitwise as it was. Two gloo ranks agreeing on the step: test_training.py's DDP
test; the whole loop on real ranks: test_supervised_faults.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.processors.core.sdc_ring import relative_gap
from trainguard.producers import ring_check
from trainguard.producers.agent import MemorySink
from trainguard.producers.device_fault import WrongDevice, install_wrong_device, uninstall_wrong_device
from trainguard.producers.grad_checks import self_check
from trainguard.producers.train_state import ResumableSampler
from trainguard.producers.training import Supervisor
from trainguard.schemas import RingCheck, RunRingCheck

from .test_rank_handlers import signed

DATA = torch.randn(256, 8, generator=torch.Generator().manual_seed(5))


def batch_of(rank: int, step: int) -> torch.Tensor:
    """Any rank's batch at any step: a pure function, as a sampler gives it."""
    return DATA[torch.randperm(256, generator=torch.Generator().manual_seed(1000 * step + rank))[:16]]


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )


def supervisor(
    tmp_path: Path, model: torch.nn.Module, rank: int = 0, **kw: Any
) -> tuple[Supervisor, MemorySink]:
    sink = MemorySink()
    sup = Supervisor(
        "run-h", rank=rank, world_size=3, sink=sink, model=model, run_dir=tmp_path, gpu_reader=None, **kw
    )
    sup.replay_fn = lambda batch: model(batch).square().mean().backward()
    sup.batch_fn = batch_of
    return sup, sink


def train(sup: Supervisor, model: torch.nn.Module, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        with sup.step(step, batch_of(sup.rank, step)) as s:
            loss = model(s.batch).square().mean()
            loss.backward()
            if s.check(loss):
                opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def ring_command(step: int, offset: int = 1) -> RunRingCheck:
    return signed(RunRingCheck, f"ring-{step}", step=step, check_id=f"ring-a0-s{step}", offset=offset)  # type: ignore[no-any-return]


def test_a_ring_check_reports_both_values_and_leaves_training_bitwise(tmp_path: Path) -> None:
    plain_model = net()
    plain, _ = supervisor(tmp_path, plain_model)
    expected = train(plain, plain_model, 6)
    plain.close()

    model = net()
    sup, sink = supervisor(tmp_path, model)
    sup.control.current_step = 3  # the command names step 2, which this rank has passed
    assert "ring check ring-a0-s2" in sup.handlers.run_ring_check(ring_command(2), 0)
    assert "already due" in sup.handlers.run_ring_check(ring_command(2), 0)
    got = train(sup, model, 6)
    sup.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))  # dropout RNG included
    (report,) = sink.of(RingCheck)  # no agreement without torch.distributed: at the first step >= 2
    assert (report.step, report.check_id, report.peer_rank) == (2, "ring-a0-s2", 1)
    assert math.isfinite(report.own_value) and report.own_value != report.peer_value
    assert sup.counters.ring_checks == 1 and sup.counters.ring_check_s > 0


def test_the_handler_refuses_without_a_batch_function(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path, net())
    sup.batch_fn = None
    with pytest.raises(RuntimeError, match=r"no batch function .*batch_fn\(rank, step\)"):
        sup.handlers.run_ring_check(ring_command(0), 0)
    sup.close()


def test_a_wrong_device_fails_both_of_its_comparisons_and_passes_its_self_check() -> None:
    """Three ranks with the same weights, rank 1's device wrong by 1e-3: the core's two
    comparisons through rank 1 fail, the third is bitwise equal (gap 0)."""
    model = net()
    model.eval()
    params = list(model.parameters())

    def replay(batch: torch.Tensor) -> None:
        model(batch).square().mean().backward()

    results = {}
    for rank in range(3):
        if rank == 1:
            install_wrong_device(1e-3)
        try:
            results[rank] = ring_check.ring_check(
                replay, batch_of, params, rank=rank, world_size=3, step=7, check_id="c", offset=1
            )
            if rank == 1:
                assert self_check(replay, batch_of(1, 7), params, 7, "mb").passed  # wrong the same way twice
        finally:
            uninstall_wrong_device()
    # edge r -> r + 1: r's recomputation of r + 1's microbatch against r + 1's own value
    gaps = {r: relative_gap(results[r].peer_value, results[(r + 1) % 3].own_value) for r in range(3)}
    assert gaps[2] == 0.0  # healthy against healthy: bitwise
    assert gaps[0] > 1e-4 and gaps[1] > 1e-4  # both of rank 1's comparisons


def test_the_ranks_run_the_oldest_check_they_all_hold_and_drop_one_not_all_will() -> None:
    def reduce(*pending: int | None) -> ring_check.RingAgreement:
        codes = [ring_check.agreement_codes(p) for p in pending]
        return ring_check.agreed([max(column) for column in zip(*codes, strict=True)])

    assert reduce(None, None) == ring_check.RingAgreement()
    assert reduce(10, None) == ring_check.RingAgreement()  # not yet on every rank: wait
    assert reduce(10, 10, 10) == ring_check.RingAgreement(run=10)
    assert reduce(10, 20) == ring_check.RingAgreement(stale=10)  # rank 1 never gets 10: drop it
    assert reduce(0, 0) == ring_check.RingAgreement(run=0)


def test_the_sampler_gives_any_ranks_batch_at_any_step() -> None:
    world, batch = 4, 16
    for rank in range(world):
        sampler = ResumableSampler(200, rank=rank, world_size=world, seed=3)  # 50 a rank: epochs wrap
        stream = (index for _ in range(10) for index in sampler)
        trained = [[next(stream) for _ in range(batch)] for _ in range(12)]
        other = ResumableSampler(200, rank=(rank + 1) % world, world_size=world, seed=3)
        assert [other.indices(rank, step * batch, batch) for step in range(12)] == trained


def test_the_supervisor_installs_the_wrong_device_at_its_step(tmp_path: Path) -> None:
    struck = WrongDevice(node="node-0000", local_rank=1, from_step=2)
    other, _ = supervisor(tmp_path, net(), node="node-0001", local_rank=1, wrong_device=struck)
    assert other.wrong_device is None  # another node's device is fine
    other.close()
    sup, _ = supervisor(tmp_path, net(), node="node-0000", local_rank=1, wrong_device=struck)
    wrapped = []
    try:
        for step in range(4):
            with sup.step(step, batch_of(1, step)):
                wrapped.append(hasattr(torch.nn.functional.linear, "__wrapped__"))
    finally:
        uninstall_wrong_device()
        sup.close()
    assert wrapped == [False, False, True, True]  # from its step's start


def test_a_failing_hook_skips_the_report_and_a_non_finite_value_still_fails(tmp_path: Path) -> None:
    model = net()
    sup, sink = supervisor(tmp_path, model)

    def broken(rank: int, step: int) -> torch.Tensor:
        raise IndexError("the user's sampler")

    sup.batch_fn = broken
    sup.handlers.run_ring_check(ring_command(0), 0)
    train(sup, model, 2)  # training goes on
    sup.close()
    assert sink.of(RingCheck) == [] and sup.control.ring_checks_due == []
    assert ring_check.reportable(math.nan) == ring_check.reportable(math.inf) > 1e300
    assert not relative_gap(ring_check.reportable(math.nan), 1.0) <= 1.0  # fails any tolerance
