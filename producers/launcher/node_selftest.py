"""The node self-test (seed §SDC (c)): short workloads with known answers, one process per
device of the node, before a suspected node returns to the pool or a spare joins the job.

- ``gemm``: on each device, matrix products of small-integer matrices whose exact product
  is computed beforehand in integer arithmetic (numpy int64, outside torch). Every entry
  and every partial sum is an integer small enough to be exact in the dtype (fp32:
  |sum| <= 2^24; bf16: <= 2^8; fp16: <= 2^11), so the right answer is bit-exact whatever
  the kernel's summation order, split-K or tiling: ``torch.equal`` against the known
  product, no tolerance. A device that computes deterministically wrong (the case a
  bitwise self-check replay cannot see, seed §7 failure 3) fails it.
- ``collective``: an all-reduce (sum) of known small integers across the node's processes
  (gloo on CPU, NCCL on GPU); every rank checks the exact total.

:func:`run_node_self_test` spawns the workers (``python -m trainguard.producers.launcher.node_selftest
--worker``, one per local rank, each with ``LOCAL_RANK`` and ``TRAINGUARD_NODE`` set as a
rank would have them) and gathers their one-line JSON reports into a
:class:`NodeSelfTestReport`. The chaos knob of :mod:`..chaos` is honoured: a worker
on the device it strikes installs the wrong device before testing, so a drill shows a
real failing self-test. ``trainguard selftest`` is the command line; the launcher runs it
on quarantined nodes and spares (:mod:`.launcher`).

Measured on a loaded 2-core CPU machine (gloo, 2 workers): most of the wall time is the
workers' ``import torch``; the tests themselves take milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..chaos import install_wrong_device, wrong_device_from_env

#: The self-tests a node can run (RunNodeSelfTest.tests).
SELF_TESTS = ("gemm", "collective")
#: (m, k, n) of the known-answer products: square, tall, and odd sizes (other kernels and tails).
GEMM_SHAPES = ((64, 64, 64), (96, 256, 128), (33, 255, 65))
#: Largest |entry| per dtype: with k <= 256, every partial sum stays exactly representable.
_ENTRY_BOUND = {"float32": 3, "bfloat16": 1, "float16": 1}
_COLLECTIVE_LEN = 4096
_SEED = 20240615


@dataclass(frozen=True)
class CheckResult:
    """One test on one device."""

    test: str
    local_rank: int
    device: str
    passed: bool
    detail: str
    seconds: float


@dataclass
class NodeSelfTestReport:
    """Every worker's results for one node; `passed` only if every test passed everywhere."""

    node: str
    tests: list[str]
    results: list[CheckResult] = field(default_factory=list)
    #: Problems outside the tests themselves (a worker that died, timed out or said nothing).
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def failed_tests(self) -> list[str]:
        failed = {r.test for r in self.results if not r.passed}
        if self.errors:
            failed |= {t for t in self.tests if not any(r.test == t for r in self.results if r.passed)}
        return [t for t in self.tests if t in failed]

    @property
    def passed(self) -> bool:
        return not self.errors and not self.failed_tests and bool(self.results)

    def summary(self) -> str:
        if self.passed:
            devices = len({r.local_rank for r in self.results})
            tests = ", ".join(self.tests)
            return f"node {self.node} passed {tests} on {devices} device(s) in {self.wall_s:.1f}s"
        wrong = [f"{r.test} on local rank {r.local_rank} ({r.detail})" for r in self.results if not r.passed]
        return f"node {self.node} failed: " + "; ".join(wrong + self.errors)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "passed": self.passed,
            "tests": self.tests,
            "failed_tests": self.failed_tests,
            "summary": self.summary(),
            "wall_s": self.wall_s,
            "results": [asdict(r) for r in self.results],
            "errors": self.errors,
        }


# --------------------------------------------------------------------------- the tests


def known_operands(m: int, k: int, n: int, bound: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer matrices with entries in [-bound, bound] (int64)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-bound, bound + 1, (m, k)), rng.integers(-bound, bound + 1, (k, n))


def gemm_check(device: Any, dtypes: Sequence[str], local_rank: int = 0) -> CheckResult:
    """Known-answer products on `device` in each of `dtypes`; fails at the first wrong one."""
    import torch

    start = time.perf_counter()
    done = 0
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for i, (m, k, n) in enumerate(GEMM_SHAPES):
            a, b = known_operands(m, k, n, _ENTRY_BOUND[dtype_name], _SEED + i)
            expected = torch.from_numpy(a @ b).to(torch.float64)  # int64 arithmetic: exact
            ta = torch.from_numpy(a).to(device=device, dtype=dtype)
            tb = torch.from_numpy(b).to(device=device, dtype=dtype)
            # torch.mm looked up at call time: the entry point a wrong device (or the chaos
            # knob that models one) goes through.
            got = torch.mm(ta, tb).to(torch.float64).cpu()
            if not torch.equal(got, expected):
                wrong = int((got != expected).sum())
                err = float((got - expected).abs().max())
                detail = f"{dtype_name} {m}x{k}x{n}: {wrong} of {m * n} entries wrong, max error {err:g}"
                return CheckResult(
                    "gemm", local_rank, str(device), False, detail, time.perf_counter() - start
                )
            done += 1
    detail = f"{done} products exact ({', '.join(dtypes)})"
    return CheckResult("gemm", local_rank, str(device), True, detail, time.perf_counter() - start)


def collective_check(device: Any, local_rank: int, world: int) -> CheckResult:
    """All-reduce (sum) of known integers over the initialised default group; checks the total."""
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    base = torch.arange(_COLLECTIVE_LEN, dtype=torch.float32) % 17 + 1
    mine = (base * (local_rank + 1)).to(device)
    dist.all_reduce(mine, op=dist.ReduceOp.SUM)
    expected = base * (world * (world + 1) // 2)
    got = mine.cpu()
    if torch.equal(got, expected):
        detail = f"all-reduce of {_COLLECTIVE_LEN} values over {world} rank(s) exact"
        return CheckResult("collective", local_rank, str(device), True, detail, time.perf_counter() - start)
    wrong = int((got != expected).sum())
    detail = f"all-reduce over {world} rank(s): {wrong} of {_COLLECTIVE_LEN} values wrong"
    return CheckResult("collective", local_rank, str(device), False, detail, time.perf_counter() - start)


# --------------------------------------------------------------------------- one worker


def worker(environ: Mapping[str, str], tests: Sequence[str]) -> list[CheckResult]:
    """One device's tests, in this process (the environment a rank would have: LOCAL_RANK,
    LOCAL_WORLD_SIZE, TRAINGUARD_NODE, MASTER_ADDR/PORT)."""
    import torch

    local_rank = int(environ.get("LOCAL_RANK", "0"))
    world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    node = environ.get("TRAINGUARD_NODE", "")
    knob = wrong_device_from_env(environ)
    if knob is not None and knob.strikes(node, local_rank):
        install_wrong_device(knob.bias, knob.delay_s)  # a fire drill: this device computes wrong answers
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device: Any = torch.device("cuda", torch.cuda.current_device())
        backend, dtypes = "nccl", ["float32", "float16", "bfloat16"]
        torch.backends.cuda.matmul.allow_tf32 = False  # exact anyway; keep the fp32 path plain
    else:
        device, backend, dtypes = torch.device("cpu"), "gloo", ["float32", "bfloat16"]
    results: list[CheckResult] = []
    if "gemm" in tests:
        results.append(gemm_check(device, dtypes, local_rank))
    if "collective" in tests:
        import datetime

        import torch.distributed as dist

        addr, port = environ.get("MASTER_ADDR", "127.0.0.1"), environ["MASTER_PORT"]
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{addr}:{port}",
                rank=local_rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=float(environ.get("TRAINGUARD_SELFTEST_TIMEOUT_S", "60"))),
            )
            results.append(collective_check(device, local_rank, world))
        except Exception as exc:  # a peer that never came, a broken link: the test failed
            detail = f"{type(exc).__name__}: {exc}"[:500]
            results.append(CheckResult("collective", local_rank, str(device), False, detail, 0.0))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return results


# --------------------------------------------------------------------------- the node


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def run_node_self_test(
    node: str,
    nproc: int,
    tests: Sequence[str] = SELF_TESTS,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    master_addr: str = "127.0.0.1",
    fork: Fork | None = None,
) -> NodeSelfTestReport:
    """Run `tests` on `nproc` devices of `node` (one worker process per local rank) and wait
    at most `timeout_s`; a worker that fails to report counts as a failure. `fork` (the
    launcher's fork server, :meth:`.fork_server.ForkServers.popen`) starts a worker from a
    process that imported torch already, when it can; else each is a new process."""
    unknown = [t for t in tests if t not in SELF_TESTS]
    if unknown or not tests or nproc < 1:
        raise ValueError(f"tests must be some of {SELF_TESTS} and nproc >= 1 (got {list(tests)}, {nproc})")
    start = time.monotonic()
    report = NodeSelfTestReport(node, list(tests))
    base = {**os.environ, **(env or {})}
    base.update(
        TRAINGUARD_NODE=node,
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(_free_port(master_addr)),
        TRAINGUARD_SELFTEST_TIMEOUT_S=str(timeout_s),
    )
    # torchrun's thread rule, the node's ranks' own, so that a worker may be forked from the
    # server that imported torch for them (imported here: the workers need none of rank_env).
    from .import_env import omp_threads

    if "OMP_NUM_THREADS" not in base:
        base.update(omp_threads(nproc))
    argv = [
        sys.executable,
        "-m",
        "trainguard.producers.launcher.node_selftest",
        "--worker",
        "--tests",
        ",".join(tests),
    ]
    procs = [_start(argv, {**base, "LOCAL_RANK": str(r), "RANK": str(r)}, fork) for r in range(nproc)]
    deadline = start + timeout_s
    for r, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            report.errors.append(f"local rank {r}: no answer within {timeout_s:g}s")
            continue
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (err.strip().splitlines() or ["no output"])[-1][:300]
            report.errors.append(f"local rank {r}: worker exited {proc.returncode}: {tail}")
            continue
        for item in json.loads(lines[-1])["results"]:
            report.results.append(CheckResult(**item))
    report.wall_s = time.monotonic() - start
    return report


#: Starts a worker from a process that imported torch: (argv, env) -> a Popen-like object
#: (communicate, kill, returncode), or None when it cannot.
Fork = Callable[[list[str], dict[str, str]], Any]


def _start(argv: list[str], env: dict[str, str], fork: Fork | None) -> Any:
    """One worker: forked by `fork` when it can, else a new process; output captured (text)."""
    forked = fork(argv, env) if fork is not None else None
    if forked is not None:
        return forked
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def default_nproc(environ: Mapping[str, str] = os.environ) -> int:
    """Devices of this node: LOCAL_WORLD_SIZE if set, else the NVIDIA devices, else 2 (CPU:
    two processes, so that the collective crosses a process boundary)."""
    if environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(environ["LOCAL_WORLD_SIZE"]))
    gpus = [p for p in Path("/dev").glob("nvidia[0-9]*")]
    return len(gpus) or 2


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One self-test worker (run_node_self_test starts these).")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--tests", default=",".join(SELF_TESTS))
    args = parser.parse_args(argv)
    results = worker(os.environ, [t for t in args.tests.split(",") if t])
    print(json.dumps({"results": [asdict(r) for r in results]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
