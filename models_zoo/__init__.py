"""Model zoo for fxmem: real-size architectures with small test configs, keyed by name.

Each module exports ``build(test: bool = False) -> ModelSpec``; ``test=True``
gives the same architecture at a size that runs forward+backward on CPU in
well under a second. All models trace with ``torch.fx.symbolic_trace`` when
built under ``torch.device("meta")``.
"""

from __future__ import annotations

from collections.abc import Callable

from fxmem.results import ModelSpec

from . import gpt2_small, gpt_7b, lstm_lm, resnet50, unet3d, vit_b16, wide_mlp

__all__ = ["ZOO"]

ZOO: dict[str, Callable[..., ModelSpec]] = {
    "gpt2-small": gpt2_small.build,
    "gpt-7b": gpt_7b.build,
    "wide-mlp": wide_mlp.build,
    "resnet50": resnet50.build,
    "unet3d": unet3d.build,
    "vit-b16": vit_b16.build,
    "lstm-lm": lstm_lm.build,
}
