"""Optimizers torch does not ship, written so that their state and their step's temporaries are those
of the real thing: fxmem runs ``step()`` on fake tensors to see what it allocates.

- ``Lion`` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2): one
  momentum buffer per parameter, no step counter; for-loop and foreach variants, as torch's own.
- ``Adafactor``: torch.optim.Adafactor with torch's own state (its ``_init_group``) and the same
  update, but with the two per-parameter norms kept as 0-dim tensors: torch's step calls ``.item()``
  on them, which no fake tensor can answer.
- ``Adam8bit``: bitsandbytes' blockwise 8-bit Adam (``bnb.optim.Adam8bit``) as far as memory goes: the
  same state tensors (see Note [Adam8bit state]); the update itself is a plain dequantize -> Adam ->
  quantize in torch ops, numerically plausible but not bit-identical to bitsandbytes' dynamic map.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.optim.optimizer import _default_to_fused_or_foreach

__all__ = ["ADAM8BIT_BLOCK", "ADAM8BIT_MIN_SIZE", "Adafactor", "Adam8bit", "Lion", "adam8bit_state_bytes"]

# Note [Adam8bit state]
# bitsandbytes/optim/optimizer.py, Optimizer2State.init_state (bitsandbytes 0.44+, with AdEMAMix): a
# parameter with fewer than ``min_8bit_size`` = 4096 elements keeps fp32 ``state1``/``state2`` (32-bit
# Adam, whatever the parameter's dtype); a larger one gets uint8 ``state1`` and ``state2`` shaped like the
# parameter plus fp32 ``absmax1``/``absmax2`` with one entry per block of 256 elements (``blocks = n //
# 256`` rounded up; releases before 0.44 used blocks of 2048). ``step`` is a Python int, no tensor. The
# two 256-entry fp32 quantization maps (``qmap1``/``qmap2``, 2 KiB) are shared by every parameter and are
# left out here: we quantize linearly per block instead of through bitsandbytes' dynamic map.
ADAM8BIT_MIN_SIZE = 4096
ADAM8BIT_BLOCK = 256


def adam8bit_state_bytes(numel: int, min_8bit_size: int = ADAM8BIT_MIN_SIZE, block: int = ADAM8BIT_BLOCK) -> int:
    """Bytes of ``Adam8bit``'s state for one parameter of ``numel`` elements. See Note [Adam8bit state]."""
    if numel < min_8bit_size:
        return 2 * numel * 4
    return 2 * numel + 2 * math.ceil(numel / block) * 4


class Lion(torch.optim.Optimizer):
    """Lion: ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``, then ``m = b2 m + (1 - b2) g``.

    ``foreach=None`` picks as torch's optimizers do: foreach when every parameter is on a device with
    foreach kernels (CUDA), else the for-loop.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: invalid lr={lr}, betas={betas} or weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            avgs = [self._exp_avg(p) for p in params]
            foreach = group["foreach"]
            if foreach is None:
                _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
            update = _lion_foreach if foreach else _lion_loop
            b1, b2 = group["betas"]
            update(params, [p.grad for p in params], avgs, group["lr"], b1, b2, group["weight_decay"])
        return loss

    def _exp_avg(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]


def _lion_loop(params: list[Tensor], grads: list[Tensor], avgs: list[Tensor], lr: float, b1: float, b2: float, wd: float) -> None:
    """One parameter at a time: one parameter-sized temporary (the interpolation) at a time."""
    for p, g, m in zip(params, grads, avgs):
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(m.mul(b1).add_(g, alpha=1 - b1).sign_(), alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)


def _lion_foreach(params: list[Tensor], grads: list[Tensor], avgs: list[Tensor], lr: float, b1: float, b2: float, wd: float) -> None:
    """All parameters at once: the interpolations of every parameter are alive together."""
    if wd:
        torch._foreach_mul_(params, 1 - lr * wd)
    updates = torch._foreach_mul(avgs, b1)
    torch._foreach_add_(updates, grads, alpha=1 - b1)
    torch._foreach_sign_(updates)
    torch._foreach_add_(params, updates, alpha=-lr)
    del updates
    torch._foreach_mul_(avgs, b2)
    torch._foreach_add_(avgs, grads, alpha=1 - b2)


class Adam8bit(torch.optim.Optimizer):
    """Blockwise 8-bit Adam with bitsandbytes' state layout (see Note [Adam8bit state]).

    Each step of a quantized parameter dequantizes both moments to fp32, updates them and the
    parameter, and quantizes them back: three or four parameter-sized fp32 temporaries at a time, one
    parameter at a time. bitsandbytes does all of it in one CUDA kernel without such temporaries, so a
    simulated step's transient is an upper bound for it; the state is exact.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        min_8bit_size: int = ADAM8BIT_MIN_SIZE,
        block: int = ADAM8BIT_BLOCK,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas) or block < 1:
            raise ValueError(f"Adam8bit: invalid lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay} or block={block}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.min_8bit_size, self.block = min_8bit_size, block

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                if state["state1"].dtype == torch.uint8:
                    self._step_8bit(p, state, group)
                else:
                    _adam_update(p, p.grad, state["state1"], state["state2"], state["step"], group)
        return loss

    def _init_state(self, p: Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["state2"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return
        blocks = math.ceil(p.numel() / self.block)
        for i in (1, 2):
            state[f"state{i}"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)  # contiguous: viewed flat
            state[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    def _step_8bit(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        m = _dequantize(state["state1"], state["absmax1"], self.block, signed=True)
        v = _dequantize(state["state2"], state["absmax2"], self.block, signed=False)
        _adam_update(p, p.grad, m, v, state["step"], group)  # type: ignore[arg-type]
        _quantize(m, state["state1"], state["absmax1"], self.block, signed=True)
        del m
        _quantize(v, state["state2"], state["absmax2"], self.block, signed=False)


def _adam_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: int, group: dict[str, Any]) -> None:
    b1, b2 = group["betas"]
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().div_(math.sqrt(1 - b2**step)).add_(group["eps"])
    p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**step))


# The codes are linear in each block's absmax: m in [-absmax, absmax] as 0..254 around 127; v >= 0 as
# the square of 0..255 (v spans many orders of magnitude, so its square root is what is spread evenly).
_SIGNED, _UNSIGNED = 127.0, 255.0


def _blocks(flat: Tensor, block: int) -> Tensor:
    """``flat`` padded with zeros to whole blocks, as a (blocks, block) matrix."""
    pad = -flat.numel() % block
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block)


def _dequantize(codes: Tensor, absmax: Tensor, block: int, *, signed: bool) -> Tensor:
    x = _blocks(codes.reshape(-1).float(), block)
    x = x.sub_(_SIGNED).div_(_SIGNED) if signed else x.div_(_UNSIGNED).square_()
    return x.mul_(absmax.unsqueeze(1)).view(-1)[: codes.numel()].view(codes.shape)


def _quantize(x: Tensor, codes: Tensor, absmax: Tensor, block: int, *, signed: bool) -> None:
    blocks = _blocks(x.reshape(-1), block)
    absmax.copy_(blocks.abs().amax(dim=1))
    scaled = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    scaled = scaled.mul_(_SIGNED).round_().add_(_SIGNED) if signed else scaled.sqrt_().mul_(_UNSIGNED).round_()
    codes.view(-1).copy_(scaled.view(-1)[: codes.numel()])


class Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose step runs on fake tensors, with the same state and temporaries.

    torch's step (torch/optim/_adafactor.py, ``_single_tensor_adafactor`` and
    ``_multi_tensor_adafactor``) turns ``param.norm()`` and ``update.norm()`` into Python floats to scale
    the update; here they stay 0-dim tensors and the scale is applied in place to the update, so the
    parameter-sized allocations are torch's: the variance estimate, which becomes the update. As in
    torch, ``foreach=None`` means the for-loop on every device.
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            rows: list[Tensor | None] = []
            cols: list[Tensor | None] = []
            variances: list[Tensor | None] = []
            steps: list[Tensor] = []
            self._init_group(group, params, grads, rows, cols, variances, steps)
            for i, _p in enumerate(params):
                steps[i] += 1
                if group["maximize"]:
                    grads[i] = -grads[i]
            if params:
                run = _adafactor_foreach if group["foreach"] else _adafactor_loop
                run(params, grads, rows, cols, variances, [float(s.item()) for s in steps], group)
        return loss


def _adafactor_loop(
    params: list[Tensor], grads: list[Tensor], rows: list[Tensor | None], cols: list[Tensor | None],
    variances: list[Tensor | None], steps: list[float], group: dict[str, Any],
) -> None:
    for p, g, row, col, var, step in zip(params, grads, rows, cols, variances, steps):
        eps1, lr, decay = _adafactor_scalars(p, step, group)
        alpha = _adafactor_alpha(p, step, group)
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        if row is not None and col is not None:
            row.lerp_(torch.norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)), decay)
            col.lerp_(torch.norm(g, dim=-2, keepdim=True).square_().div_(g.size(-2)), decay)
            estimate = (row @ col).div_(row.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            assert var is not None, "Adafactor keeps a variance for every parameter below 2 dims"
            var.lerp_(g * g, decay)
            estimate = var.clone()
        update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
        p.add_(update.mul_(alpha.neg_().div_(_adafactor_denom(update, group))))


def _adafactor_foreach(
    params: list[Tensor], grads: list[Tensor], rows: list[Tensor | None], cols: list[Tensor | None],
    variances: list[Tensor | None], steps: list[float], group: dict[str, Any],
) -> None:
    """torch groups matrices and vectors apart and updates each group with _foreach ops; so do we."""
    for factored in (True, False):
        idx = [i for i, g in enumerate(grads) if (g.dim() > 1) == factored]
        if not idx:
            continue
        ps, gs = [params[i] for i in idx], [grads[i] for i in idx]
        eps1, lr, _ = _adafactor_scalars(ps[0], steps[idx[0]], group)
        decays = [_adafactor_scalars(params[i], steps[i], group)[2] for i in idx]
        alphas = [_adafactor_alpha(params[i], steps[i], group) for i in idx]
        if group["weight_decay"]:
            torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
        if factored:
            estimates = _factored_estimates(gs, [rows[i] for i in idx], [cols[i] for i in idx], decays, eps1)  # type: ignore[misc]
        else:
            vs: list[Tensor] = [variances[i] for i in idx]  # type: ignore[misc]
            squared = torch._foreach_mul(gs, gs)
            torch._foreach_lerp_(vs, squared, decays)
            del squared
            estimates = [v.clone() for v in vs]
        torch._foreach_clamp_min_(estimates, eps1 * eps1)
        torch._foreach_rsqrt_(estimates)
        torch._foreach_mul_(estimates, gs)
        scales = [a.neg_().div_(_adafactor_denom(u, group)) for a, u in zip(alphas, estimates)]
        torch._foreach_mul_(estimates, scales)
        torch._foreach_add_(ps, estimates)


def _factored_estimates(gs: list[Tensor], rows: list[Tensor], cols: list[Tensor], decays: list[float], eps1: float) -> list[Tensor]:
    for dim, factors in ((-1, rows), (-2, cols)):
        means = [torch.norm(g, dim=dim, keepdim=True) for g in gs]
        torch._foreach_mul_(means, means)
        torch._foreach_div_(means, [float(g.size(dim)) for g in gs])
        torch._foreach_lerp_(factors, means, decays)
        del means
    estimates = [r @ c for r, c in zip(rows, cols)]
    row_means = [r.mean(dim=-2, keepdim=True) for r in rows]
    torch._foreach_clamp_min_(row_means, eps1)
    torch._foreach_div_(estimates, row_means)
    return estimates


def _adafactor_scalars(p: Tensor, step: float, group: dict[str, Any]) -> tuple[float, float, float]:
    """eps1 (the dtype's eps when unset), lr and the step's 1 - beta2 = step ** beta2_decay."""
    eps1 = group["eps"][0]
    lr = float(group["lr"])
    return (torch.finfo(p.dtype).eps if eps1 is None else eps1), lr, step ** group["beta2_decay"]


def _adafactor_alpha(p: Tensor, step: float, group: dict[str, Any]) -> Tensor:
    """max(eps2, RMS(p)) * min(lr, 1/sqrt(step)), as a 0-dim tensor; computed before weight decay."""
    rho = min(float(group["lr"]), 1 / step**0.5)
    return (p.norm(2) / p.numel() ** 0.5).clamp_(min=group["eps"][1]).mul_(rho)


def _adafactor_denom(update: Tensor, group: dict[str, Any]) -> Tensor:
    """max(1, RMS(update) / d): torch's update clipping."""
    return (update.norm(2) / (update.numel() ** 0.5 * group["d"])).clamp_(min=1.0)


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
