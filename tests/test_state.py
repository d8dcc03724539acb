"""Model state: each optimizer rule against the real optimizer's state after one real step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxmem.errors import InputSpecError
from fxmem.rules.optimizers import OPTIMIZERS
from fxmem.state import get_optimizer, state_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    m[2].bias.requires_grad_(False)  # a frozen parameter: no gradient, no optimizer state
    return m


def _measured_optimizer_bytes(model: nn.Module, name: str) -> int:
    opt = OPTIMIZERS.rules()[name].make([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("name", list(OPTIMIZERS.rules()))
def test_optimizer_rule_matches_the_real_state(name: str) -> None:
    model = _model()
    predicted = state_bytes(model, optimizer=get_optimizer(name)).optimizer
    assert predicted == _measured_optimizer_bytes(model, name)


def test_weights_gradients_and_buffers_by_hand() -> None:
    # Parameters: 8*16+16 + 16+16 + 16*4+4 = 244 floats; the frozen bias (4) has no gradient.
    # Buffers: BatchNorm1d running_mean, running_var (16 floats each) + num_batches_tracked (int64).
    s = state_bytes(_model(), optimizer=get_optimizer("adamw"))
    assert s.parameters == 244 and s.trainable == 240
    assert s.weights == 244 * 4 and s.gradients == 240 * 4
    assert s.buffers == 32 * 4 + 8
    # AdamW: exp_avg + exp_avg_sq per trainable float, plus a 4-byte step per trainable tensor (5 of them).
    assert s.optimizer == 2 * 240 * 4 + 5 * 4
    assert s.total == s.weights + s.buffers + s.gradients + s.optimizer


def test_tied_weights_count_once_and_param_dtype_overrides() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    s = state_bytes(nn.ModuleList([emb, head]), optimizer=get_optimizer("sgd"), param_dtype=torch.bfloat16)
    assert s.parameters == 40 and s.weights == 40 * 2 and s.weights_by_dtype == {"bfloat16": 80}


def test_unknown_optimizer_lists_the_choices() -> None:
    with pytest.raises(InputSpecError, match="adamw"):
        get_optimizer("adamx")
