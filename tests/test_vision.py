"""torchvision:NAME and timm:NAME specs. The libraries do not import beside this torch here, so the
plumbing is checked with stand-in modules that have the same API, and the real libraries where installed."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import LoadError


class _Weights:
    class DEFAULT:  # mirrors torchvision's weights enum member
        @staticmethod
        def transforms() -> types.SimpleNamespace:
            return types.SimpleNamespace(crop_size=[96])


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))


@pytest.fixture
def fake_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    models = types.SimpleNamespace(list_models=lambda: ["tiny"], get_model=lambda name, weights=None: _tiny(), get_model_weights=lambda name: _Weights)
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(models=models))


def test_torchvision_spec_builds_on_meta_with_its_weights_input_size(fake_torchvision: None) -> None:
    spec = fxmem.load_model("torchvision:tiny")
    assert all(p.is_meta for p in spec.model.parameters())
    assert list(spec.inputs) == ["B,3,96,96"] and spec.loss == "cross_entropy"
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, target="cpu")
    # ReLU keeps its output: 4 channels x 47 x 47 floats per sample ((96 - 3) // 2 + 1 = 47).
    assert report.node_bytes(2)["_1"] == 2 * 4 * 47 * 47 * 4


def test_unknown_torchvision_name_is_a_clear_error(fake_torchvision: None) -> None:
    with pytest.raises(LoadError, match="torchvision has no model 'nope'"):
        fxmem.load_model("torchvision:nope")


def test_timm_spec_takes_the_models_own_input_size(monkeypatch: pytest.MonkeyPatch) -> None:
    def create_model(name: str, pretrained: bool = False) -> nn.Module:
        model = _tiny()
        model.pretrained_cfg = {"input_size": (3, 64, 64)}  # type: ignore[assignment]
        return model

    monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(create_model=create_model))
    spec = fxmem.load_model("timm:tiny")
    assert list(spec.inputs) == ["B,3,64,64"]


def test_a_library_that_does_not_import_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import then raises ImportError
    with pytest.raises(LoadError, match=r"needs timm.*pip install timm"):
        fxmem.load_model("timm:vit_base_patch16_224")


def test_real_torchvision_resnet50_where_installed() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - a mismatched torchvision fails with RuntimeError or AttributeError, not only ImportError
        pytest.skip("torchvision does not import beside this torch")
    spec = fxmem.load_model("torchvision:resnet50")
    assert list(spec.inputs) == ["B,3,224,224"]
    assert fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, peak=False, target="cpu").activations.per_sample > 0


def test_real_timm_vit_where_installed() -> None:
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - a mismatched timm fails with RuntimeError or AttributeError, not only ImportError
        pytest.skip("timm does not import beside this torch")
    spec = fxmem.load_model("timm:vit_base_patch16_224")
    assert list(spec.inputs) == ["B,3,224,224"]
    with torch.device("meta"):
        assert fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, peak=False, target="cpu").activations.per_sample > 0
