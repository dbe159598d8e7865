"""The wrong-device chaos knob: deterministic, scoped to one device of one node."""

from __future__ import annotations

import time

import pytest

from trainguard.producers.chaos.device_fault import (
    WrongDevice,
    install_wrong_device,
    uninstall_wrong_device,
    wrong_device_from_env,
)

torch = pytest.importorskip("torch")


def test_the_spec_parses_and_names_one_device_from_its_step() -> None:
    spec = "node=node-0001,local_rank=1,from_step=40"
    fault = wrong_device_from_env({"TRAINGUARD_INJECT_WRONG_DEVICE": spec})
    assert fault == WrongDevice("node-0001", 1, 40, 1e-3)
    assert fault.strikes("node-0001", 1, 40) and not fault.strikes("node-0001", 1, 39)
    assert not fault.strikes("node-0001", 0, 50) and not fault.strikes("spare-0000", 1, 50)
    assert fault.strikes("node-0001", 1)
    assert wrong_device_from_env({}) is None
    with pytest.raises(ValueError, match="local_rank=N"):
        wrong_device_from_env({"TRAINGUARD_INJECT_WRONG_DEVICE": "node=node-0001"})


def test_products_are_wrong_the_same_way_every_time_until_uninstalled() -> None:
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(4, 2)
    right = torch.mm(a, b)
    try:
        install_wrong_device(1e-3)
        install_wrong_device(1e-3)  # idempotent: not scaled twice
        first, second = torch.mm(a, b), torch.nn.functional.linear(a, b.T)
        assert torch.equal(first, second) and torch.equal(first, torch.mm(a, b))
        assert torch.allclose(first, right * 1.001) and not torch.equal(first, right)
    finally:
        uninstall_wrong_device()
    assert torch.equal(torch.mm(a, b), right)


def test_a_slow_device_computes_right_after_its_delay() -> None:
    spec = "node=node-0001,local_rank=0,from_step=20,delay_s=0.02"
    fault = wrong_device_from_env({"TRAINGUARD_INJECT_SLOW_DEVICE": spec})
    assert fault == WrongDevice("node-0001", 0, 20, bias=0.0, delay_s=0.02)
    with pytest.raises(ValueError, match="delay_s=SECONDS"):
        wrong_device_from_env({"TRAINGUARD_INJECT_SLOW_DEVICE": "node=node-0001,local_rank=0"})
    with pytest.raises(ValueError, match="both set"):
        wrong_device_from_env({"TRAINGUARD_INJECT_SLOW_DEVICE": spec, "TRAINGUARD_INJECT_WRONG_DEVICE": spec})
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    right = torch.mm(a, a.T)
    install_wrong_device(fault.bias, fault.delay_s)
    try:
        started = time.perf_counter()
        slow = torch.mm(a, a.T)
        waited = time.perf_counter() - started
    finally:
        uninstall_wrong_device()
    assert torch.equal(slow, right) and waited >= 0.02
