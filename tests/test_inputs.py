"""Inputs as users pass them: shape specs become tensors with a batch axis; every other value (a flag,
None, a float, a list of ints) passes through to forward() unchanged, in the Python API and on the CLI
(--arg NAME=VALUE); a structure holding shape specs is refused with what to pass instead."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.errors import InputSpecError
from fxmem.inputs import Constant, InputSpec, parse_inputs
from fxmem.output.render import format_expr


class _Scaled(nn.Module):
    """A forward() with non-tensor arguments that change what the step computes: ``scale`` multiplies,
    ``twice`` runs the layer a second time (Python control flow, so torch.fx cannot trace it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0, twice: bool = False, note: object = None) -> torch.Tensor:
        assert note is None or note == [1, 2], note  # passed through as given
        y = torch.relu(self.fc(x)) * scale
        if twice:
            y = torch.relu(self.fc(y))
        return y


def test_values_that_are_not_shapes_pass_through() -> None:
    specs = parse_inputs({"x": "B,8", "scale": 0.5, "twice": True, "note": None, "ids": [1, 2]})
    assert specs[0] == InputSpec("x", ("B", 8))
    assert [(s.name, s.value) for s in specs[1:] if isinstance(s, Constant)] == [
        ("scale", 0.5), ("twice", True), ("note", None), ("ids", [1, 2]),
    ]  # fmt: skip


@pytest.mark.parametrize("twice", [False, True])
def test_a_flag_changes_what_the_step_saves(twice: bool) -> None:
    """The flag reaches forward(): with ``twice`` the second Linear and ReLU save more, and the
    prediction equals the measured real run at every batch either way."""
    model = _Scaled()
    inputs = {"x": "B,8", "scale": 0.5, "twice": twice, "note": [1, 2]}
    report = fxmem.analyze(model, inputs, loss="sum", target="cpu")
    for b in (1, 3):
        assert report.activation_bytes(b) == fxmem.measure(model, inputs, b, loss="sum").total
    once = fxmem.analyze(model, {"x": "B,8", "twice": False}, loss="sum", target="cpu")
    # The second Linear saves its input y (8 floats a sample) and its ReLU its output (8 more): 64 B a sample.
    assert report.activations.per_sample - once.activations.per_sample == (64 if twice else 0)


def test_positional_constants_keep_their_place() -> None:
    model = _Scaled()
    report = fxmem.analyze(model, ["B,8", 2.0, True], loss="sum", target="cpu")
    assert report.activation_bytes(2) == fxmem.measure(model, ["B,8", 2.0, True], 2, loss="sum").total


def test_a_structure_of_shapes_is_refused_with_what_to_do() -> None:
    with pytest.raises(InputSpecError) as e:
        parse_inputs({"images": "B,3,32,32", "targets": [{"boxes": "B,4", "labels": "B:int64"}]})
    message = str(e.value)
    assert "input 'targets'" in message and "'B,4'" in message and "wrap the model" in message and "\n" not in message


def test_cli_arg_passes_a_literal(tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """--arg twice=true on the CLI is the Python API's {"twice": True}: the same saved bytes."""
    path = tmp_path / "scaled.py"  # type: ignore[operator]
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x, twice=False):\n"
        "        y = torch.relu(self.fc(x))\n"
        "        return torch.relu(self.fc(y)) if twice else y\n"
        "def build():\n    return M()\n"
    )
    args = [f"{path}:build", "--input", "x=B,8", "--loss", "sum", "--target", "cpu", "--format", "json"]
    assert main(["analyze", *args, "--arg", "twice=true"]) == 0
    with_flag = json.loads(capsys.readouterr().out)
    assert main(["analyze", *args]) == 0
    without = json.loads(capsys.readouterr().out)
    assert {"name": "twice", "value": "True"} in with_flag["inputs"]
    # The second Linear's input is the first ReLU's output, saved already (a storage counts once); the
    # second ReLU saves its own output: 8 floats, 32 bytes a sample.
    assert with_flag["activations"]["per_sample"] - without["activations"]["per_sample"] == 32


def test_cli_arg_that_is_a_shape_points_to_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "zoo:wide-mlp:test", "--arg", "labels=B,4", "--target", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--input labels=B,4" in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (pip install 'fxmem[hf]')")
def test_clip_contrastive_loss_is_quadratic_in_the_batch() -> None:
    """CLIP with ``return_loss=True``: the contrastive loss's logits are B x B (text by image), so its
    saved bytes have a B^2 term; the prediction equals a real CPU run at B = 1, 2, 3 and 5. fxmem keeps B
    symbolic through ``torch.arange(len(logits))`` (Note [len() of a batch-sized tensor])."""
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100, max_position_embeddings=16
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    inputs = {"input_ids": "B,16:int64", "pixel_values": "B,3,32,32", "return_loss": True}
    report = fxmem.analyze(model, inputs, loss="model", target="cpu")
    # The B^2 coefficient by hand: the (B, B) fp32 logits the matmul makes (4 bytes an element), saved
    # once, and the log-softmax each of the two cross-entropies (text->image, image->text) saves of
    # them (4 bytes an element each): 12 bytes per B^2.
    assert report.activations.higher == (12,)
    assert format_expr(report.activations).startswith("12 B·B^2") and "12 B·B^2" in str(report)
    for b in (1, 2, 3, 5):
        assert report.activation_bytes(b) == fxmem.measure(model, inputs, b, loss="model").total, b
