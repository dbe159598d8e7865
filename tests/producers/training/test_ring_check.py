"""The ring cross-rank check on the rank side (producers/training/ring_check.py), without a broker:
the handler, the value each rank reports, the step agreement, and that a check leaves
training bitwise as it was. Two gloo ranks agreeing on the step: test_training.py's DDP
test; the whole loop on real ranks: test_supervised_faults.py.

The three-rank cross check that bisects a lone ring edge (producers/training/cross_check.py): its
agreement, the handler's refusals, and four gloo ranks running it through the registered
handler, with and without a wrong device among the three."""

from __future__ import annotations

import math
import os
import queue
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainguard.processors.core.detectors.sdc_checks import bisect_three
from trainguard.processors.core.detectors.sdc_ring import relative_gap
from trainguard.producers.chaos.device_fault import (
    WrongDevice,
    install_wrong_device,
    uninstall_wrong_device,
)
from trainguard.producers.checkpoint.train_state import ResumableSampler
from trainguard.producers.rank.agent import MemorySink
from trainguard.producers.rank.gate import CommandGate, GateVerdict
from trainguard.producers.rank.handlers import RankControl
from trainguard.producers.training import cross_check, ring_check
from trainguard.producers.training.cross_check import CrossCheck
from trainguard.producers.training.grad_checks import self_check
from trainguard.producers.training.supervisor import Supervisor
from trainguard.schemas import (
    Command,
    CrossRankCheck,
    Reason,
    ReasonCode,
    RingCheck,
    RunCrossRankCheck,
    RunRingCheck,
    auth,
    encode,
)

from ..rank.test_rank_handlers import KEY, RUN, signed

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
    tmp_path: Path, model: torch.nn.Module, rank: int = 0, world_size: int = 3, **kw: Any
) -> tuple[Supervisor, MemorySink]:
    sink = MemorySink()
    sup = Supervisor(
        RUN, rank=rank, world_size=world_size, sink=sink, model=model, run_dir=tmp_path, gpu_reader=None, **kw
    )
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    sup.replay_fn = lambda batch: inner(batch).square().mean().backward()  # no collective
    sup.batch_fn = batch_of
    return sup, sink


def train(
    sup: Supervisor, model: torch.nn.Module, steps: int, arrive: dict[int, Command] | None = None
) -> list[torch.Tensor]:
    """`steps` steps; `arrive[step]` reaches this rank's registered handler at that step."""
    handlers = Registered(sup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        with sup.step(step, batch_of(sup.rank, step)) as s:
            if arrive is not None and step in arrive:
                handlers.deliver(arrive[step], sup.rank)
            loss = model(s.batch).square().mean()
            loss.backward()
            if s.check(loss):
                opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def ring_command(step: int, offset: int = 1) -> RunRingCheck:
    return signed(RunRingCheck, f"ring-{step}", step=step, check_id=f"ring-a0-s{step}", offset=offset)  # type: ignore[no-any-return]


def unsupervised_run(tmp_path: Path, steps: int) -> list[torch.Tensor]:
    """The weights of `steps` plain steps (no check commanded): what a check must not change."""
    model = net()
    plain, _ = supervisor(tmp_path, model)
    weights = train(plain, model, steps)
    plain.close()
    return weights


def test_a_ring_check_reports_both_values_and_leaves_training_bitwise(tmp_path: Path) -> None:
    expected = unsupervised_run(tmp_path, 6)

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


# --------------------------------------------------------------------------- cross check


class Registered:
    """The handlers as the actuator holds them (RankHandlers.register), fed a signed
    command through the actuator's gate for one rank, as the actuator does."""

    def __init__(self, sup: Supervisor) -> None:
        self.handlers: dict[type[Command], Any] = {}
        sup.handlers.register(self)

    def register(self, kind: type[Command], handler: Any) -> None:
        self.handlers[kind] = handler

    def deliver(self, command: Command, rank: int) -> str:
        decision, verdicts = CommandGate(RUN, 0, [rank], KEY).admit(encode(command))
        assert verdicts == {rank: GateVerdict.EXECUTE} and decision.command is not None
        return self.handlers[type(command)](decision.command, rank)  # type: ignore[no-any-return]


def cross_command(ranks: list[int], batch_rank: int | None, step: int = 1) -> RunCrossRankCheck:
    """The bisection sdc_ring sends for the lone edge ranks[0] -> ranks[1] of a ring at `step`."""
    command = RunCrossRankCheck(
        command_id=f"x-{ranks}-{batch_rank}", run_id=RUN, attempt=0, issued_ts=1.0,
        reason=Reason(code=ReasonCode.CROSS_RANK_MISMATCH, text="test"), ranks=ranks, step=step,
        microbatch_id=f"ring-a0-s{step}/r{batch_rank}", batch_rank=batch_rank,
    )  # fmt: skip
    return auth.sign(command, KEY)


def test_the_cross_check_handler_refuses_what_it_cannot_run_and_queues_the_rest_once(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path, net())
    handlers = Registered(sup)
    for command, why in [
        (cross_command([0, 1, 2], None), "no batch_rank"),
        (cross_command([0, 1, 5], 1), r"ranks \[5\] are outside world size 3"),
        (cross_command([0, 1, 2], 3), r"ranks \[3\] are outside world size 3"),
        (cross_command([0, 0, 1], 1), "2 or 3 distinct ranks"),
    ]:
        with pytest.raises(RuntimeError, match=why):  # the actuator's FAILED ack, with this text
            handlers.deliver(command, 0)
    sup.batch_fn = None
    with pytest.raises(RuntimeError, match=r"no batch function .*batch_fn\(rank, step\)"):
        handlers.deliver(cross_command([0, 1, 2], 1), 0)
    sup.batch_fn, sup.replay_fn = batch_of, None
    with pytest.raises(RuntimeError, match="no replay function"):
        handlers.deliver(cross_command([0, 1, 2], 1), 0)
    assert sup.control.cross_checks_due == []
    sup.replay_fn = lambda batch: None
    assert "recompute rank 1's microbatch of step 1" in handlers.deliver(cross_command([0, 1, 2], 1), 0)
    assert "already due" in handlers.deliver(cross_command([0, 1, 2], 1), 0)
    assert [c.microbatch_id for c in sup.control.cross_checks_due] == ["ring-a0-s1/r1"]
    sup.close()


def test_without_the_agreement_a_cross_check_is_dropped_and_training_goes_on(tmp_path: Path) -> None:
    expected = unsupervised_run(tmp_path, 3)
    model = net()
    sup, sink = supervisor(tmp_path, model)  # no process group: nowhere to gather the values
    got = train(sup, model, 3, arrive={1: cross_command([0, 1, 2], 1, step=0)})
    sup.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert sink.of(CrossRankCheck) == [] and sup.control.cross_checks_due == []
    assert sup.counters.cross_checks == 0


def test_the_ranks_join_the_smallest_cross_check_once_every_rank_it_names_holds_it() -> None:
    def reduce(held: dict[int, list[CrossCheck]], world: int = 4) -> int | None:
        codes = [cross_check.agreement_codes(cross_check.head(held.get(r, [])), r) for r in range(world)]
        return cross_check.agreed([max(column) for column in zip(*codes, strict=True)])

    a = CrossCheck(5, "ring-a0-s5/r1", (0, 1, 2), 1, since=9)
    b = CrossCheck(5, "ring-a0-s5/r3", (2, 3, 0), 3, since=9)
    pair = CrossCheck(7, "mb-7", (1, 3), 3)
    assert a.key == CrossCheck(5, "ring-a0-s5/r1", (0, 1, 2), 1, since=12).key != b.key  # content only
    assert reduce({}) is None
    assert reduce({0: [a], 1: [a]}) is None  # rank 2 does not hold it yet: wait
    assert reduce({0: [a], 1: [a], 2: [a]}) == a.key  # rank 3, not named, takes part all the same
    assert reduce({1: [pair], 3: [pair]}) == pair.key  # two ranks: the first fills the third slot
    assert reduce({1: [pair]}) is None
    first, second = sorted([a, b], key=lambda c: c.key)
    both = {0: [a, b], 1: [a], 2: [b, a], 3: [b]}  # each rank received them in its own order
    assert reduce(both) == first.key
    assert reduce({r: [c for c in held if c != first] for r, held in both.items()}) == second.key

    # The values: each named rank's at its index, zeros elsewhere, summed; a NaN (a failed
    # recomputation) reports nothing.
    parts = [cross_check.contribution(b, r, 10.0 + r) for r in range(4)]
    summed = [sum(column) for column in zip(*parts, strict=True)]
    assert cross_check.reported(b, summed) == [12.0, 13.0, 10.0]
    assert cross_check.reported(b, [12.0, math.nan, 10.0]) is None

    # Held too long (a rank it names never got it): dropped; one that came before the
    # first step is held from the first agreement on.
    control = RankControl(cross_checks_due=[a, pair])  # a since step 9, pair before the first step
    head, gone = control.cross_check_head(100)
    assert head is not None and head.key == min(a.key, pair.key) and gone == []
    head, gone = control.cross_check_head(9 + cross_check.PATIENCE_STEPS + 1)
    assert head is not None and (head.microbatch_id, head.since) == ("mb-7", 100) and gone == [a]


WORLD = 4
#: The bisection of ring edge 1 -> 3 at step 1 with rank 0; rank 2 is not named.
XRANKS, XBATCH, XSTEP = [1, 3, 0], 3, 1
#: The step at which the command reaches each named rank: they all hold it from step 3.
ARRIVES = {1: 1, 3: 2, 0: 3}


def _cross_rank(rank: int, port: int, run_dir: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for run in ("plain", "checked", "wrong"):
        model = net()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        wrong = WrongDevice(node="node-3", local_rank=0) if run == "wrong" else None  # rank 3's device
        sup, sink = supervisor(Path(run_dir), ddp, rank, WORLD, node=f"node-{rank}", wrong_device=wrong)
        command = cross_command(XRANKS, XBATCH, XSTEP)
        arrive = {ARRIVES[rank]: command} if run != "plain" and rank in ARRIVES else None
        weights = train(sup, ddp, 5, arrive)
        uninstall_wrong_device()
        sup.close()
        reports = [(e.rank, e.step, e.microbatch_id, e.ranks, e.values) for e in sink.of(CrossRankCheck)]
        counts = (sup.counters.cross_checks, sup.counters.cross_check_s > 0, sup.control.cross_checks_due)
        results[run] = (torch.cat([w.reshape(-1) for w in weights]).numpy().tobytes(), reports, counts)
    out.put((rank, results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cross_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Four gloo ranks (DDP), three runs each: no check, the check, the check with rank 3's
    device wrong."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[3]))  # spawned ranks import this
        return _spawn_cross_ranks(str(tmp_path_factory.mktemp("xrank")))


def _spawn_cross_ranks(run_dir: str) -> dict[int, dict[str, Any]]:
    # A fork server that has imported torch and this module once, rather than four fresh
    # interpreters importing them (~5 s of CPU each); each rank is a fork of that clean
    # process (no threads, no CUDA), not of pytest.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", _cross_rank.__module__])
    out = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_cross_rank, args=(r, port, run_dir, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + 90
        while len(results) < WORLD:
            assert time.monotonic() < deadline, "ranks did not report"
            assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
            try:
                rank, runs = out.get(timeout=0.5)
            except queue.Empty:
                continue
            results[rank] = runs
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


def test_the_named_ranks_recompute_the_edges_microbatch_and_the_first_reports_one_check(
    cross_ranks: dict[int, dict[str, Any]],
) -> None:
    reports = [report for r in range(WORLD) for report in cross_ranks[r]["checked"][1]]
    ((reporter, step, microbatch, ranks, values),) = reports  # one, from the first named rank
    assert (reporter, step, microbatch, ranks) == (1, 3, f"ring-a0-s{XSTEP}/r{XBATCH}", XRANKS)
    assert values[0] == values[1] == values[2] and math.isfinite(values[0]) and values[0] > 0
    for rank in range(WORLD):
        weights, _, (checks, took_time, left) = cross_ranks[rank]["checked"]
        assert weights == cross_ranks[rank]["plain"][0] == cross_ranks[0]["plain"][0]  # bitwise, every rank
        assert (checks, took_time, left) == (1 if rank in XRANKS else 0, True, [])  # rank 2 joined only


def test_a_wrong_device_among_the_three_is_the_odd_one_out(cross_ranks: dict[int, dict[str, Any]]) -> None:
    ((reporter, step, _, ranks, values),) = [rep for r in range(WORLD) for rep in cross_ranks[r]["wrong"][1]]
    assert (reporter, step, ranks) == (1, 3, XRANKS)
    assert values[0] == values[2] != values[1]  # rank 3's device; the two good ones bitwise equal
    verdict = bisect_three(values, 1e-6 * values[0])
    assert verdict.liar is not None and ranks[verdict.liar] == 3
