"""The catalogue of bad inputs: each ends in exit status 2 and one line on stderr that names the culprit
and the way out, with no traceback. See docs/errors.md for the table users read.

Every test goes through ``fxmem.cli.main`` as the ``fxmem`` script does; two run ``python -m fxmem`` in a
subprocess to prove that nothing else (a traceback, torch's own error log) reaches the terminal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fxmem import cli
from fxmem.api import analyze
from fxmem.errors import CaptureError, FxmemError, FxmemWarning, InputSpecError
from fxmem.frontends.load import load_leaf_types, load_model
from fxmem.inputs import InputSpec, parse_inputs
from fxmem.measure import measure_peak
from fxmem.planner.search import plan

ROOT = Path(__file__).resolve().parent.parent
M = "tests/models_for_errors.py"


pytestmark = pytest.mark.usefixtures("at_repo_root")


def error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, assert exit 2, nothing on stdout and exactly one 'fxmem: error:' line; return it."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}\nstdout: {out}\nstderr: {err}"
    assert out == ""
    assert err.startswith("fxmem: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# (argv, substrings the message must contain), one entry per mistake; the id says what is wrong.
CATALOGUE = [
    # Input shapes and dtypes.
    pytest.param(["--input", "B,3,,224"], ["'B,3,,224'", "'' is not a dimension", "B,3,224,224"], id="shape-empty-dim"),
    pytest.param(["--input", "B,x"], ["'B,x'", "unknown symbol 'x'", "positive integer"], id="shape-symbol-x"),
    pytest.param(["--input", "3,224"], ["'3,224'", "no batch axis", "B,3,224,224"], id="shape-without-B"),
    pytest.param(["--input", "B,B,3"], ["'B,B,3'", "more than once", "exactly one axis"], id="shape-B-twice"),
    pytest.param(["--input", "B,-1"], ["'B,-1'", "dimension -1 must be a positive integer"], id="shape-negative"),
    pytest.param(["--input", "B,0"], ["'B,0'", "dimension 0 must be a positive integer"], id="shape-zero"),
    pytest.param(["--input", "B,T,64"], ["'B,T,64'", "unknown symbol 'T'", "written 'B'", "'S'"], id="shape-symbol-T"),
    pytest.param(["--input", "B,S,64"], ["symbolic sequence axis S", "--seq-len"], id="shape-S-without-seq-len"),
    pytest.param(["--input", "B,3:float33"], ["unknown dtype 'float33'", "float32", "bfloat16"], id="dtype-unknown"),
    pytest.param(["--input", "B,8:"], ["'B,8:'", "nothing after ':'", "B,1024:int64"], id="dtype-empty"),
    pytest.param(["--input", "=B,8"], ["'=B,8'", "not a valid keyword name"], id="keyword-empty"),
    pytest.param(["--input", "x=B,8", "--input", "B,8"], ["comes after a keyword input", "positional inputs first"], id="positional-after-keyword"),
    # Sizes.
    pytest.param(["--device-memory", "-1"], ["--device-memory '-1' is not a size", "80GiB"], id="device-memory-negative"),
    pytest.param(["--device-memory", "abc"], ["--device-memory 'abc' is not a size", "GiB", "GB"], id="device-memory-abc"),
    pytest.param(["--device-memory", "0"], ["--device-memory '0' is 0 bytes", "80GiB"], id="device-memory-zero"),
    pytest.param(["--device-memory", "0.5B"], ["--device-memory '0.5B' is 0 bytes"], id="device-memory-half-byte"),
    # Options argparse checks: one line too, pointing at --help.
    pytest.param(["--batch", "0"], ["argument --batch: '0' is not a positive integer", "fxmem analyze --help"], id="batch-zero"),
    pytest.param(["--batch", "-3"], ["argument --batch: '-3' is not a positive integer"], id="batch-negative"),
    pytest.param(["--batch", "x"], ["argument --batch: 'x' is not a whole number"], id="batch-not-a-number"),
    pytest.param(["--top", "0"], ["argument --top: '0' is not a positive integer"], id="top-zero"),
    pytest.param(["--depth", "-1"], ["argument --depth: '-1' is negative"], id="depth-negative"),
    pytest.param(["--loss", "hinge"], ["argument --loss: invalid choice: 'hinge'", "cross_entropy"], id="loss-unknown"),
    pytest.param(["--format", "bad"], ["argument --format: invalid choice: 'bad'", "json"], id="format-unknown"),
    pytest.param(["--optimizer", "adamm"], ["unknown optimizer 'adamm'", "adamw", "sgd-momentum"], id="optimizer-unknown"),
    pytest.param(["--param-dtype", "float33"], ["--param-dtype: unknown dtype 'float33'", "bfloat16"], id="param-dtype-unknown"),
    pytest.param(["--param-dtype", "int64"], ["--param-dtype: 'int64' is not a floating-point dtype"], id="param-dtype-int"),
    # --leaf names.
    pytest.param(["--leaf", "Lineer"], ["--leaf 'Lineer'", "did you mean 'Linear'?", "package.module:ClassName"], id="leaf-unknown"),
    pytest.param(["--leaf", "functional"], ["--leaf 'functional'", "not an nn.Module class"], id="leaf-not-a-class"),
    pytest.param(["--leaf", "nosuchpkg.mod:Block"], ["--leaf 'nosuchpkg.mod:Block'", "cannot import module 'nosuchpkg.mod'"], id="leaf-missing-module"),
    # The training setup.
    pytest.param(["--gpu", "h100"], ["unknown GPU 'h100'", "Did you mean 'h100-80gb' or 'h100-pcie' or 'h100-nvl'?"], id="gpu-unknown"),
    pytest.param(["--target", "cpu", "--shard", "zero3", "--world-size", "8"], ["--shard zero3", "--target cuda"], id="shard-on-cpu"),
    pytest.param(["--overhead", "cuda_context"], ["--overhead 'cuda_context'", "NAME=SIZE"], id="overhead-without-size"),
    pytest.param(["--overhead", "ctx=1GiB"], ["unknown overhead 'ctx'", "cuda_context", "cublas_workspace"], id="overhead-unknown-line"),
    pytest.param(["--optimizer", "rmsprop", "--optimizer-impl", "fused"], ["'rmsprop' has no fused implementation", "--optimizer-impl"], id="impl-missing"),
    pytest.param(["--precision", "fp8"], ["invalid choice: 'fp8'", "mixed"], id="precision-unknown"),
    pytest.param(["--bn-threshold", "0"], ["--bn-threshold", "1 or more"], id="bn-threshold-zero"),
]


@pytest.mark.parametrize(("options", "expected"), CATALOGUE)
def test_bad_option(capsys: pytest.CaptureFixture[str], options: list[str], expected: list[str]) -> None:
    line = error_line(capsys, "analyze", f"{M}:linear_8_4", *options)
    for text in expected:
        assert text in line


SPECS = [
    pytest.param("zoo:wide-mlpp", ["unknown zoo model 'wide-mlpp'", "did you mean 'wide-mlp'?", "gpt2-small, gpt-7b, wide-mlp"], id="zoo-unknown-name"),
    pytest.param("zoo:nope", ["unknown zoo model 'nope'", "resnet50", "lstm-lm"], id="zoo-unknown-no-guess"),
    pytest.param("zoo:wide-mlp:big", ["unknown variant 'big'", "zoo:wide-mlp:test"], id="zoo-unknown-variant"),
    pytest.param("nosuchpkg.models:build", ["cannot import module 'nosuchpkg.models'", "PYTHONPATH"], id="module-missing"),
    pytest.param("models_zoo.wide_mlp:bild", ["no attribute 'bild'", "did you mean 'build'?"], id="factory-missing"),
    pytest.param(f"{M}:nothing_like_it", ["no attribute 'nothing_like_it'", "it defines", "linear_8_4"], id="factory-missing-lists"),
    pytest.param("missing/model.py:build", ["no file 'missing/model.py'", ".py file"], id="file-missing"),
    pytest.param(f"{M}:raises", ["the factory raised RuntimeError", "weights.yaml"], id="factory-raises"),
    pytest.param(f"{M}:returns_string", ["returned str, not an nn.Module", "fxmem.ModelSpec"], id="factory-returns-str"),
    pytest.param(f"{M}:needs_arguments", ["missing 1 required positional argument: 'hidden'", "wrap it in a function"], id="factory-needs-args"),
    pytest.param(f"{M}:NOT_CALLABLE", ["'NOT_CALLABLE' is an int, not a factory"], id="factory-not-callable"),
    pytest.param("wide_mlp", ["'wide_mlp' is not understood", "did you mean 'zoo:wide-mlp'?"], id="spec-without-colon"),
    pytest.param(M, ["is not understood", f"'{M}:build'"], id="spec-file-without-factory"),
    pytest.param(f"{M}:no_inputs", ["has no default inputs", "--input B,3,224,224"], id="no-default-inputs"),
    pytest.param(f"{M}:bad_default_inputs", ["invalid default inputs ['B,x']", "unknown symbol 'x'", "Pass --input"], id="bad-default-inputs"),
    pytest.param(f"{M}:unknown_default_loss", ["asks for loss 'hinge'", "pass --loss"], id="unknown-default-loss"),
]


@pytest.mark.parametrize(("spec", "expected"), SPECS)
def test_bad_model_spec(capsys: pytest.CaptureFixture[str], spec: str, expected: list[str]) -> None:
    line = error_line(capsys, "analyze", spec)
    for text in expected:
        assert text in line


MODELS = [
    pytest.param([f"{M}:returns_int"], ["returned int", "tensor output", "forward() returns"], id="output-int"),
    pytest.param([f"{M}:returns_str"], ["returned str", "tensor output"], id="output-str"),
    pytest.param([f"{M}:returns_none"], ["returned NoneType", "tensor output"], id="output-none"),
    pytest.param([f"{M}:two_inputs", "--input", "B,8"], ["needs input 'mask'", "--input mask=B,"], id="input-missing"),
    pytest.param([f"{M}:linear_8_4", "--input", "B,8", "--input", "B,8"], ["takes inputs (input)", "2 positional"], id="inputs-too-many"),
    pytest.param([f"{M}:linear_8_4", "--input", "mask=B,8"], ["takes inputs (input)", "'mask'", "forward() signature"], id="keyword-unknown"),
    # The node, its module, the input shape and the weight's shape.
    pytest.param([f"{M}:linear_8_4", "--input", "B,7"], ["node '_0'", "module '0'", "(B, 7)", "[B, 7] X [8, 4]", "--input shapes"], id="shape-rejected"),
    pytest.param(
        [f"{M}:branchy"],
        # Issue 39: a branch on values leads with the user's line and module; --leaf (which meets the same branch) is not offered.
        ["branches on a tensor's value at", "models_for_errors.py:96 (if x.sum() > 0", "in module 'gate' (_Gate)", "torch.where(cond, a, b)"],
        id="untraceable",
    ),
    pytest.param(
        [f"{M}:count_branch"],
        ["branches on a count that only the data fixes", "models_for_errors.py:", "if keep.numel() == 0", "in module '1' (_Select)", "torch._check"],
        id="count-branch",
    ),
    # Issue 39: LayerDrop is refused with its cause, its module, the field that turns it off, and why that is the worst case.
    *[
        pytest.param(
            [f"{M}:layerdrop_{draw}"],
            ["branches on a random number in training at", "in module 'encoder' (_LayerDropStack)", "if self.training and chance < self.layerdrop",
             "LayerDrop", "Set layerdrop (now 0.1) to 0", "worst case"],
            id=f"layerdrop-{draw}",
        )  # fmt: skip
        for draw in ("torch", "numpy")
    ],
    # Issue 36: the plain cause first.
    pytest.param(
        [f"{M}:needs_mode"],
        ["forward() of model", "needs argument 'mode', which the inputs do not give: pass --arg mode=... (Python: inputs={..., 'mode': ...})", "models_for_errors.py:"],
        id="argument-missing",
    ),
    pytest.param([f"{M}:needs_mode", "--frontend", "export"], ["needs argument 'mode'", "--arg mode=..."], id="argument-missing-export"),
    pytest.param(
        [f"{M}:expects_rgb", "--input", "B,1,8,8"],
        ['its own assert failed: "expects RGB" at', "models_for_errors.py:", "assert x.shape[1] == 3", "B,1,8,8:float32", "--input"],
        id="assert-fails",
    ),
    pytest.param(
        [f"{M}:expects_rgb", "--frontend", "fx"],
        ['the model\'s assert "expects RGB" at', "models_for_errors.py:", "cannot evaluate an assert", "--frontend export"],
        id="assert-under-fx",
    ),
    pytest.param(
        [f"{M}:tiny_lm", "--input", "B,16"],
        ["Embedding 'wte'", "needs integer ids", "float32 (B,16)", "give the input a dtype: --input B,16:int64"],
        id="float-ids",
    ),
    pytest.param(
        [f"{M}:tiny_lm", "--input", "B,16", "--frontend", "export"],
        ["Embedding 'wte' needs integer ids", "give the input a dtype: --input B,16:int64"],
        id="float-ids-export",
    ),
    pytest.param(
        [f"{M}:fused_qkv", "--tp", "2", "--tp-plan", "qkv=colwise", "--tp-plan", "proj=rowwise", "--optimizer-impl", "for-loop", "--target", "cpu"],
        ["shards module 'qkv' (Linear, colwise)", "24 on each rank", "splits that output", "IndexError", "splits it by heads", "leave 'qkv' out of the plan"],
        id="tp-fused-qkv",
    ),
]


@pytest.mark.parametrize(("argv", "expected"), MODELS)
def test_bad_model(capsys: pytest.CaptureFixture[str], argv: list[str], expected: list[str]) -> None:
    line = error_line(capsys, "analyze", *argv)
    for text in expected:
        assert text in line


def test_the_plain_cause_leads(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 36: the cause a user can fix opens the message, not fx's words about control flow."""
    assert error_line(capsys, "analyze", f"{M}:needs_mode").startswith("fxmem: error: forward() of model ")
    assert "control flow" not in error_line(capsys, "analyze", f"{M}:expects_rgb", "--input", "B,1,8,8")
    assert "shape" not in error_line(capsys, "analyze", f"{M}:tiny_lm", "--input", "B,16").split("dtype")[0]


def test_the_inputs_that_pass_an_assert_or_give_the_argument_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", f"{M}:expects_rgb", "--no-peak", "--target", "cpu"]) == 0  # auto: torch.export runs the assert
    assert cli.main(["analyze", f"{M}:needs_mode", "--arg", "mode=relu", "--no-peak", "--target", "cpu"]) == 0
    capsys.readouterr()


def test_a_dict_output_says_which_entry_the_loss_uses(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", f"{M}:returns_dict", "--target", "cpu"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fxmem: note:")]
    assert notes == [f"fxmem: note: forward() of model '{M}:returns_dict' returns a dict; the loss uses its 'logits' entry, the first floating-point one."]


def test_a_dict_output_with_its_own_loss() -> None:
    spec = load_model(f"{M}:returns_dict_with_loss")
    with pytest.warns(FxmemWarning, match=r"returns a dict; the loss uses its 'logits' entry.*--loss model takes its 'loss' entry"):
        analyze(spec.model, spec.inputs, loss="sum", target="cpu", peak=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxmemWarning)  # the model's own loss: its 'loss' entry, nothing to say
        own = [analyze(spec.model, spec.inputs, loss=loss, target="cpu", peak=False) for loss in ("auto", "model")]
    assert own[0].activation_bytes(4) == own[1].activation_bytes(4)


def test_plan_says_once_that_seq_len_changes_nothing() -> None:
    with pytest.warns(FxmemWarning, match="seq_len=8 has no effect") as record:
        plan(torch.nn.Linear(8, 4), ["B,8"], target="cpu", memory=2**30, seq_len=8, allow=["batch"])
    assert len([w for w in record if "has no effect" in str(w.message)]) == 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param([], "name a command: analyze, measure, timeline, plan or zoo", id="no-command"),
        pytest.param(["bogus"], "invalid choice: 'bogus'", id="unknown-command"),
        pytest.param(["analyze"], "the following arguments are required: spec", id="no-spec"),
        pytest.param(["measure", f"{M}:linear_8_4", "--input", "B,7"], "node '_0'", id="measure-shape-rejected"),
    ],
)
def test_bad_command_line(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert expected in error_line(capsys, *argv)


@pytest.mark.parametrize("size", ["80GiB", "80 GB"])
def test_device_memory_sizes_that_parse(capsys: pytest.CaptureFixture[str], size: str) -> None:
    assert cli.main(["analyze", f"{M}:linear_8_4", "--device-memory", size, "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device_memory"] == (80 * 2**30 if size == "80GiB" else 80 * 10**9)
    assert report["max_batch"] > 10**6


def test_model_without_parameters_works(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", f"{M}:no_parameters", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_state"]["parameters"] == 0 and report["model_state"]["total"] == 0
    # Nothing requires grad (no parameters, inputs are data), so autograd saves nothing either.
    assert report["activations"] == {"per_sample": 0, "constant": 0}


def test_leaf_makes_a_shape_branch_traceable(capsys: pytest.CaptureFixture[str]) -> None:
    # torch.fx alone cannot trace it and says which module to keep opaque; auto falls back to torch.export.
    assert "--leaf _ShapeGate" in error_line(capsys, "analyze", f"{M}:shape_branchy", "--frontend", "fx")
    assert cli.main(["analyze", f"{M}:shape_branchy", "--leaf", "_ShapeGate", "--format", "json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert [n["target"] for n in nodes if n["layer"] == "gate"] == ["_ShapeGate"]


def test_leaf_names_resolve() -> None:
    model = load_model(f"{M}:attention").model
    assert load_leaf_types(["MultiheadAttention"], model) == (torch.nn.MultiheadAttention,)
    assert load_leaf_types(["torch.nn:MultiheadAttention", "MultiheadAttention"], model) == (torch.nn.MultiheadAttention,)
    assert load_leaf_types(["_Attention"], model)[0].__name__ == "_Attention"  # a class of the model itself


def test_ctrl_c_exits_130_with_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "analyze", interrupted)
    assert cli.main(["analyze", f"{M}:linear_8_4"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "fxmem: interrupted (Ctrl-C); nothing was reported.\n"


def test_a_bug_in_fxmem_is_not_disguised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only FxmemError is the user's to fix; anything else keeps its traceback (exit 1 from the script)."""

    def broken(*_a: object, **_k: object) -> None:
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(cli, "analyze", broken)
    with pytest.raises(ZeroDivisionError):
        cli.main(["analyze", f"{M}:linear_8_4"])


def test_message_survives_the_fx_interpreter() -> None:
    """fx's Interpreter.run appends 'While executing ...' and a stack trace to e.args; str() keeps the paragraph."""
    e = CaptureError("node 'x' failed.")
    e.args = (e.args[0] + "\n\nWhile executing %x\nOriginal traceback: ...",)
    assert str(e) == "node 'x' failed."
    assert isinstance(e, FxmemError)


def test_tuple_of_spec_strings_is_inputs_not_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_inputs(("B,8", "B,4:int64")) == (InputSpec(None, ("B", 8)), InputSpec(None, ("B", 4), torch.int64))
    assert parse_inputs(("B", 8)) == (InputSpec(None, ("B", 8)),)
    assert cli.main(["analyze", f"{M}:tuple_inputs"]) == 0


def _python_m_fxmem(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fxmem", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # The fake kernel fails: torch logs a traceback of its own unless the CLI quiets it.
        pytest.param(["analyze", f"{M}:linear_8_4", "--input", "B,7"], "node '_0'", id="shape-rejected"),
        pytest.param(["analyze", f"{M}:raises"], "the factory raised RuntimeError", id="factory-raises"),
    ],
)
def test_no_traceback_reaches_the_terminal(argv: list[str], expected: str) -> None:
    done = _python_m_fxmem(*argv)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert all(line.startswith("fxmem: ") for line in lines), done.stderr  # progress lines may precede the error
    assert lines[-1].startswith("fxmem: error: ") and expected in lines[-1]
    assert "Traceback" not in done.stderr


def test_measure_peak_refuses_what_one_real_step_cannot_be(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(capsys, "measure", "zoo:wide-mlp:test", "--peak", "--target", "cpu", "--precision", "mixed")
    assert "--precision apply to 'fxmem analyze' only" in line


def test_analyze_checks_its_arguments() -> None:
    """The library boundary: a non-module and leaf_types that are names, not classes, get clear errors."""
    with pytest.raises(FxmemError, match=r"needs an nn\.Module, got str"):
        analyze("zoo:wide-mlp", ["B,8"])  # type: ignore[arg-type]
    with pytest.raises(FxmemError, match=r"leaf_types must hold nn\.Module classes, got 'Linear'"):
        analyze(torch.nn.Linear(8, 4), ["B,8"], leaf_types=("Linear",))  # type: ignore[arg-type]


def test_a_real_run_that_fails_is_one_paragraph(capsys: pytest.CaptureFixture[str]) -> None:
    # The test GPT's context is 16 positions; fake tensors carry no values, so only the real run of
    # `measure` sees that 64 positions index past the position embedding.
    line = error_line(capsys, "measure", "zoo:gpt2-small:test", "--input", "B,S:int64", "--seq-len", "64", "--batch", "2")
    assert "the real CPU run at B=2 failed" in line and "IndexError" in line


def test_measure_peak_with_a_shape_the_model_rejects_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(capsys, "measure", f"{M}:linear_8_4", "--input", "B,7", "--peak")
    assert line.startswith("fxmem: error:") and "Traceback" not in line


def test_plain_measure_refuses_setup_options_it_would_ignore(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(capsys, "measure", "zoo:wide-mlp:test", "--amp", "bf16")
    assert "--amp apply to 'fxmem analyze' only" in line and "with --peak" in line


def test_measure_peak_checks_amp_before_running_anything() -> None:
    with pytest.raises(InputSpecError, match="unknown amp 'bf17'"):
        measure_peak(torch.nn.Linear(4, 2), ["B,4"], 2, amp="bf17")


def test_export_of_a_reentrant_checkpoint_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_line(capsys, "analyze", f"{M}:reentrant_checkpoints", "--frontend", "export", "--no-peak")
    assert "calls torch.utils.checkpoint in a way" in err and "use_reentrant=True" in err and "--frontend fx" in err and "use_reentrant=False" in err


def test_checkpoint_flag_outside_hf_specs_says_where_it_applies(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_line(capsys, "analyze", "zoo:wide-mlp:test", "--checkpoint")
    assert "applies to hf: specs only" in err and "torch.utils.checkpoint" in err


def test_a_checkpoint_call_torch_rejects_is_one_line_naming_its_region(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_line(capsys, "analyze", f"{M}:bad_checkpoint_option", "--target", "cpu")
    assert "torch.utils.checkpoint call whose region starts at node 'a'" in err and "determinism_check" in err


def _qwen3_spec(folder: Path) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        vocab_size=100, max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
    )  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(folder)
    return f"hf:{folder / 'config.json'}"


def test_more_layers_than_the_config_lists_types_for(tmp_path: Path) -> None:
    """--config num_hidden_layers=N on a config with layer_types: the list is fitted to N, with a note."""
    spec = _qwen3_spec(tmp_path)
    with pytest.warns(FxmemWarning, match=r"num_hidden_layers is 5 but the config's layer_types lists 2 layers; layer_types was extended"):
        model = load_model(spec, hf_config={"num_hidden_layers": "5"}, seq_len=16).model
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert len(model.model.layers) == 5
    with pytest.warns(FxmemWarning, match="cut to 1 entries"):
        assert load_model(spec, hf_config={"num_hidden_layers": "1"}, seq_len=16).model.config.layer_types == ["sliding_attention"]


def test_layer_types_of_the_wrong_length_name_both_fields(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = error_line(capsys, "analyze", _qwen3_spec(tmp_path), "--config", "num_hidden_layers=3", "layer_types=['full_attention']")
    assert "--config layer_types lists 1 layers but num_hidden_layers is 3" in line and "one type per layer" in line
