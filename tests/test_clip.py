"""The kernel's clip (common/kernel/clip.py) takes gradients, so it does not carry torch's name, and a
call written the torch way (parameters in) fails loudly instead of scaling the weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.kernel import clip
from common.kernel.clip import clip_grads_by_global_norm_


def _model_with_grads(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    model(torch.randn(4, 5, dtype=torch.float64)).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("scale", [0.1, 0.9, 1.1, 10.0])
@given(seed=st.integers(0, 2**16))
def test_clip_on_gradients_equals_torch_clip_on_parameters(seed: int, scale: float) -> None:
    """max_norm below and above ‖g‖ (scale < 1 clips, > 1 must leave the gradients alone)."""
    ours, theirs = _model_with_grads(seed), _model_with_grads(seed)
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ours.parameters()))
    max_norm = float(norm) * scale
    got = clip_grads_by_global_norm_([p.grad for p in ours.parameters()], max_norm)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, foreach=False)
    assert float(got) == pytest.approx(float(want), rel=1e-14)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-14, atol=0)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_called_the_torch_way_it_raises_and_leaves_the_weights() -> None:
    model = _model_with_grads(0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"torch\.nn\.utils\.clip_grad_norm_\(model\.parameters\(\)"):
        clip_grads_by_global_norm_(model.parameters(), 1e-3)
    with pytest.raises(TypeError, match="counted"):
        clip_grads_by_global_norm_([p.grad for p in model.parameters()], 1e-3, counted=model.parameters())
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)


def test_no_torch_name_with_another_contract() -> None:
    """torch's clip_grad_norm_(parameters, max_norm) reads p.grad; ours takes gradients."""
    assert not hasattr(clip, "clip_grad_norm_")
