"""A loop with an FSDP model (``fully_shard``), 2 real gloo ranks on CPU, supervised like a
DDP one (issue 21 item 3): every rank reports the whole gradient norm (the invariant is
judged on the same number everywhere, from sharded gradients), a sharded DCP checkpoint
is written, validated and resumed bitwise; a self-check commanded to rank 0 alone runs on
both ranks at the agreed step (the replay all-gathers), rank 0 reports it passed (each rank
digests its own unreduced gradients, so rank 1's flaky replay does not reach it), rank 1
reports its own mismatch; a ring check runs on every rank at the agreed step, each
recomputation of a neighbour's batch equal to the neighbour's own, bitwise; the run goes
on bitwise as without the checks; and a rank whose matrix products are slowed reports the
larger compute time, its peer's waits in the forward all-gathers left out. On 3 ranks, a
cross check naming two of them runs, the third joining its all-gathers. After a restart that
rebuilt every rank's model, a replaced rank gets its shards back from its peer's memory."""

from __future__ import annotations

import copy
import os
import queue
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from trainguard.producers.rank.agent import MemorySink
from trainguard.schemas import (
    CrossRankCheck,
    Reason,
    ReasonCode,
    RingCheck,
    RunCrossRankCheck,
    RunRingCheck,
    RunSelfCheck,
    SdcSelfCheck,
    StepStats,
    StepTiming,
)

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trainguard.producers.chaos.device_fault import install_wrong_device, uninstall_wrong_device  # noqa: E402
from trainguard.producers.checkpoint.manager import CheckpointManager  # noqa: E402
from trainguard.producers.checkpoint.train_state import TrainState  # noqa: E402
from trainguard.producers.training.supervisor import Supervisor  # noqa: E402

STEPS = 6
SAVED = 2


def batch(rank: int, step: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def train(sup: Supervisor, net: Any, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        x, y = batch(rank, step)
        with sup.step(step, x) as s:
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            s.compute_done()
            if s.check(loss):
                opt.step()
            opt.zero_grad()
        if step == SAVED and sup.checkpoint is not None:
            sup.checkpoint.save(step).wait()


def shards(net: Any) -> bytes:
    return b"".join(p.to_local().detach().numpy().tobytes() for p in net.parameters())


def _rank(rank: int, world: int, port: int, ckpt: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    reference = copy.deepcopy(net)  # unsharded, the same initial weights
    for layer in (net[0], net[2], net):
        fully_shard(layer)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    sink = MemorySink()
    sup = Supervisor(
        "run-fsdp", rank=rank, world_size=2, sink=sink, model=net, optimizer=opt, gpu_reader=None
    )
    replays: Counter[int] = Counter()

    def replay(b: Any) -> None:  # rank 1's device is flaky: its second self-check replay differs
        step = sup.control.current_step
        replays[step] += 1
        flaky = 1.001 if rank == 1 and step == 4 and replays[step] == 2 else 1.0
        (net(b).square().mean() * flaky).backward()

    sup.replay_fn = replay
    sup.batch_fn = lambda r, step: batch(r, step)[0]
    ckpt_manager = CheckpointManager(ckpt, TrainState(net, opt), rank=rank, world_size=2, run_id="run-fsdp")
    sup.checkpoint = None  # saved by the loop at step SAVED
    reason = Reason(code=ReasonCode.SDC_CHECK_SCHEDULED, text="the policy's periodic self-check")
    if rank == 0:  # the command names rank 0 only; both ranks must replay (the all-gathers)
        command = RunSelfCheck(
            command_id="c1", run_id="run-fsdp", attempt=0, issued_ts=0.0, step=4, reason=reason
        )
        sup.handlers.run_self_check(command, rank)
    ring = RunRingCheck(
        command_id="c2", run_id="run-fsdp", attempt=0, issued_ts=0.0, step=3, check_id="k", offset=1,
        reason=reason,
    )  # fmt: skip
    sup.handlers.run_ring_check(ring, rank)  # every rank holds it before the first step
    sup.checkpoint = ckpt_manager  # type: ignore[assignment]
    train(sup, net, opt, rank, range(STEPS))
    first = shards(net)
    ckpt_manager.wait_validated()
    resumed = ckpt_manager.load(SAVED)
    sup.checkpoint = None
    train(sup, net, opt, rank, range(SAVED + 1, STEPS))
    again = shards(net)
    # The whole gradient at step 0: the mean of both ranks' batches' gradients, unsharded.
    for r in range(2):
        x, y = batch(r, 0)
        (torch.nn.functional.mse_loss(reference(x), y) / 2).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    norms = [e.grad_norm for e in sink.of(StepStats)]
    checks = [(e.step, e.digest_first == e.digest_second) for e in sink.of(SdcSelfCheck)]
    rings = [(e.step, e.own_value, e.peer_rank, e.peer_value) for e in sink.of(RingCheck)]
    if rank == 1:  # a slow device: every matrix product waits 50 ms (two per forward)
        install_wrong_device(0.0, delay_s=0.05)
    train(sup, net, opt, rank, range(STEPS, STEPS + 3))
    uninstall_wrong_device()
    sup._drain(block=True)
    compute = [e.compute_s for e in sink.of(StepTiming) if e.step >= STEPS]
    out.put((rank, first == again, resumed, norms[0], expected, norms, checks, compute, rings))
    ckpt_manager.close()
    sup.close()
    _leave(out)


def _leave(out: Any) -> None:
    """End a rank: destroy its groups, hand its result to the parent, and exit without the
    interpreter's finalization. fully_shard keeps the gloo group alive past
    destroy_process_group (its run-loop threads with it), and a run-loop thread that is
    still releasing its last all-reduce's work when the interpreter finalizes needs the
    GIL to drop the work's tensors: the thread exits mid-destructor and the process aborts
    ("terminate called without an active exception", a core dump's stack:
    ~AsyncAllreduceWork -> decref_pyobject -> take_gil -> PyThread_exit_thread; ~1 exit in 8
    here, pytorch/pytorch#179291). What the test asserts is already in `out`."""
    dist.destroy_process_group()
    out.close()
    out.join_thread()  # the queue's feeder has written the result to the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(target: Any, world: int, *args: Any) -> dict[int, tuple[Any, ...]]:
    """Run `target(rank, world, port, *args, out)` on `world` spawned gloo ranks; what each put."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[Any, ...]] = {}
    deadline = time.monotonic() + 120
    while len(results) < world:
        assert time.monotonic() < deadline, "ranks did not report"
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        try:
            rank, *rest = out.get(timeout=0.5)
        except queue.Empty:
            continue
        results[rank] = tuple(rest)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def test_an_fsdp_loop_is_supervised_checkpointed_and_resumed_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))  # spawned ranks import this
    results = spawn(_rank, 2, str(tmp_path / "ckpt"))
    for rank in (0, 1):
        bitwise, resumed, norm, expected, _, _, _, _ = results[rank]
        assert bitwise and resumed == SAVED
        assert norm == pytest.approx(expected, rel=1e-5)
    # Rank 0 (commanded) passes: it digests its own unreduced gradients, which rank 1's flaky
    # device never reaches; rank 1, not commanded, reports because its replays disagree.
    assert results[0][5] == [(4, True)] and results[1][5] == [(4, False)]
    slow, fast = min(results[1][6]), max(results[0][6])
    assert slow >= 0.1 and fast < 0.05, (results[0][6], results[1][6])  # rank 0's waits left out
    # The ring check, at the first step both ranks held it (its command's step is not a
    # floor: the core sends it for a step passed): each rank's recomputation of its
    # neighbour's batch (the gathered weights, its own unreduced gradients) equals the
    # neighbour's own, bitwise.
    ((step0, own0, peer0, theirs0),) = results[0][7]
    ((step1, own1, peer1, theirs1),) = results[1][7]
    assert (step0, peer0, step1, peer1) == (0, 1, 0, 0)
    assert theirs0 == own1 and theirs1 == own0 and own0 != own1
    assert results[0][4] == results[1][4]  # every rank judged the same whole norm, every step
    assert (tmp_path / "ckpt" / f"step-{SAVED:09d}" / "VALIDATED").exists()


def _cross(rank: int, world: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for layer in (net[0], net[2], net):
        fully_shard(layer)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    sink = MemorySink()
    sup = Supervisor(
        "run-x", rank=rank, world_size=world, sink=sink, model=net, optimizer=opt, gpu_reader=None
    )
    sup.replay_fn = lambda b: net(b).square().mean().backward()
    sup.batch_fn = lambda r, step: batch(r, step)[0]
    if rank in (0, 1):  # the command reaches the ranks it names; rank 2 only joins
        reason = Reason(code=ReasonCode.CROSS_RANK_MISMATCH, text="bisect the edge 1 -> 2")
        cross = RunCrossRankCheck(
            command_id="c3", run_id="run-x", attempt=0, issued_ts=0.0, step=0, microbatch_id="step-0/rank-2",
            batch_rank=2, ranks=[0, 1], reason=reason,
        )  # fmt: skip
        sup.handlers.run_cross_rank_check(cross, rank)
    train(sup, net, opt, rank, range(3))
    values = [(e.step, e.ranks, e.values) for e in sink.of(CrossRankCheck)]
    out.put((rank, values))
    sup.close()
    _leave(out)


def test_an_fsdp_cross_check_names_two_ranks_and_the_third_joins_its_all_gathers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks 0 and 1 recompute rank 2's batch; rank 2, not named, replays a batch of its own
    (value discarded) so that their forwards' all-gathers complete; rank 0 reports both
    values, equal bitwise."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    results = spawn(_cross, 3)
    ((step, ranks, values),) = results[0][0]
    assert (step, ranks) == (0, [0, 1]) and values[0] == values[1] and values[0] > 0
    assert results[1] == ([],) and results[2] == ([],)


def _state_bytes(net: Any, opt: Any) -> bytes:
    """This rank's shards of the parameters and of the optimizer's moments."""
    moments = [t.to_local() if hasattr(t, "to_local") else t for s in opt.state.values() for t in s.values()]
    return shards(net) + b"".join(t.detach().numpy().tobytes() for t in moments)


def _sharded(seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for layer in (net[0], net[2], net):
        fully_shard(layer)
    return net, torch.optim.AdamW(net.parameters(), lr=0.01)


def _replica(rank: int, world: int, port: int, ckpt: str, out: Any) -> None:
    from trainguard.producers.checkpoint.peer_replica import PeerReplica

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # Made once, by every rank together (new_group is a collective): a replaced rank's
    # manager and replica are built again on them, as the DDP test does.
    ckpt_group, peer_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")

    def manager(net: Any, opt: Any, replica: PeerReplica) -> CheckpointManager:
        state = TrainState(net, opt, rank=rank)
        return CheckpointManager(
            ckpt,
            state,
            rank=rank,
            world_size=world,
            run_id="run-fsdp",
            process_group=ckpt_group,
            replica=replica,
        )

    def steps(net: Any, opt: Any, span: range) -> None:
        for step in span:
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()

    net, opt = _sharded(0)
    replica = PeerReplica(rank, world, run_id="run-fsdp", process_group=peer_group)
    mgr = manager(net, opt, replica)
    steps(net, opt, range(3))
    mgr.save(2)
    mgr.wait_validated()
    saved = _state_bytes(net, opt)
    steps(net, opt, range(3, 5))  # the run went on past the snapshot
    went_on = shards(net)
    dist.barrier()
    # The restart rebuilds the model on every rank (fully_shard, other initial weights);
    # rank 1's process is replaced: its host memory, and so its replica, are gone.
    mgr.close()
    net, opt = _sharded(1)
    if rank == 1:
        replica.close()
        replica = PeerReplica(rank, world, run_id="run-fsdp", process_group=peer_group)
    mgr = manager(net, opt, replica)
    assert mgr.load() == 2
    restored = _state_bytes(net, opt)
    source = mgr.last_restore
    steps(net, opt, range(3, 5))  # and the run goes on from the restored shards
    out.put((rank, restored == saved, source, shards(net) == went_on))
    mgr.close()
    replica.close()
    _leave(out)


def test_a_replaced_fsdp_rank_gets_its_shards_back_from_its_peers_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process restart's peer replica with a sharded model: each rank's copy holds its
    own shards (a DTensor travels as its local shard); after a restart that rebuilt every
    rank's model, rank 1 (replaced: no host copies) gets its parameter and moment shards back
    from rank 0's memory, rank 0 from its own, bitwise, and the steps after it end where
    they had before the failure."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    results = spawn(_replica, 2, str(tmp_path / "ckpt"))
    assert results[0] == (True, (2, "own"), True)
    assert results[1] == (True, (2, "peer"), True)
