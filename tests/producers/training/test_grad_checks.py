"""Gradient digest, grad norm and the bitwise self-check replay (real torch, CPU)."""

from __future__ import annotations

import torch

from trainguard.producers.training.grad_checks import flip_bit, grad_digest, grad_norm, self_check


def model_and_batch(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
        torch.nn.Linear(32, 4),
    )  # fmt: skip
    return model, torch.randn(8, 16)


def backward(model: torch.nn.Module, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()


def test_digest_is_bitwise() -> None:
    model, batch = model_and_batch()
    torch.manual_seed(1)
    backward(model, batch)
    first = grad_digest(model)
    twin, _ = model_and_batch()
    torch.manual_seed(1)
    backward(twin, batch)
    assert grad_digest(twin) == first and first.startswith("sha256:")
    grad = list(model.parameters())[2].grad
    assert grad is not None
    flip_bit(grad, 5, 0)  # lowest mantissa bit of one element
    assert grad_digest(model) != first
    flip_bit(grad, 5, 0)
    assert grad_digest(model) == first
    # a missing gradient is not the same as a zero one
    p = next(model.parameters())
    p.grad = None
    no_grad = grad_digest(model)
    p.grad = torch.zeros_like(p)
    assert grad_digest(model) != no_grad


def test_grad_norm_matches_clip_grad_norm() -> None:
    model, batch = model_and_batch()
    backward(model, batch)
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    assert abs(grad_norm(model) - expected) <= 1e-6 * expected
    next(model.parameters()).grad[0, 0] = float("nan")  # type: ignore[index]
    assert grad_norm(model) != grad_norm(model)  # nan


def test_self_check_passes_on_a_deterministic_model_and_leaves_state_alone() -> None:
    model, batch = model_and_batch()
    backward(model, batch)  # the training step's own gradients
    grads = [p.grad for p in model.parameters()]
    before = [g.clone() for g in grads if g is not None]
    running_mean = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    result = self_check(lambda b: backward(model, b), batch, model, step=7, microbatch_id="mb-7")
    assert result.passed and result.digest_first.startswith("sha256:")
    assert (result.step, result.microbatch_id) == (7, "mb-7")
    # the replay put back what it found: the same grad tensors, buffers and RNG state
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True) if g is not None)
    assert torch.equal(model[1].running_mean, running_mean)
    assert torch.equal(torch.get_rng_state(), rng)


def test_self_check_catches_one_flipped_bit() -> None:
    model, batch = model_and_batch()
    runs = []

    def faulty(b: torch.Tensor) -> None:
        backward(model, b)
        runs.append(1)
        if len(runs) == 2:  # the second computation of the same microbatch is wrong by one bit
            flip_bit(list(model.parameters())[-1].grad, 1, 3)  # type: ignore[arg-type]

    result = self_check(faulty, batch, model, step=3, microbatch_id="mb")
    assert not result.passed and result.digest_first != result.digest_second
