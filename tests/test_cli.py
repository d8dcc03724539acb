"""The happy paths of the ``fxmem`` command line, through ``fxmem.cli.main`` as the script runs it."""

from __future__ import annotations

import csv
import io
import json
import re
import time
from pathlib import Path

import pytest

from fxmem import cli
from fxmem.api import analyze
from fxmem.frontends.load import load_model
from fxmem.gpu.overheads import CUBLAS_KERNELS_BYTES
from models_zoo import ZOO

ROOT = Path(__file__).resolve().parent.parent
MLP = "zoo:wide-mlp:test"


pytestmark = pytest.mark.usefixtures("at_repo_root")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    return out


def test_json_has_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(run(capsys, "analyze", MLP, "--format", "json", "--device-memory", "24GB"))
    for key in ("model", "inputs", "model_state", "activations", "nodes", "layers", "at_batch", "max_batch", "device_memory"):
        assert key in report
    assert report["model"] == MLP
    assert report["device_memory"] == 24 * 10**9 and report["max_batch"] > 0
    assert report["at_batch"]["batch"] == 32
    assert sum(layer["bytes_at_batch"] for layer in report["layers"]) == report["at_batch"]["activations"]


def test_csv_rows_add_up_to_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    rows = list(csv.reader(io.StringIO(run(capsys, "analyze", MLP, "--format", "csv", "--batch", "4"))))
    assert rows[0][:3] == ["Layer", "Op", "Output shape"] and rows[0][5] == "At B=4"
    *layers, total = rows[1:]
    assert total[0] == "Total activations"
    assert sum(int(r[5]) for r in layers) == int(total[5]) > 0


def test_markdown_is_a_github_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "analyze", MLP, "--format", "markdown")
    assert re.search(r"^\| Layer +\| Op", out, re.M)
    assert re.search(r"^\|-+\|", out, re.M)


def test_depth_groups_by_top_level_module(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(run(capsys, "analyze", "zoo:resnet50:test", "--depth", "1", "--format", "json"))
    names = [layer["layer"] for layer in report["layers"]]
    assert "layer1" in names and not any("." in n for n in names)


def _layer_names(text: str) -> list[str]:
    """The first cell of each row of the layer table, Total row excluded."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Layer ")) + 2  # header, rule
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("Total activations"))
    return [re.split(r"\s{2,}", line)[0] for line in lines[start:end]]


def test_depth_all_and_the_default_depth(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["analyze", "zoo:resnet50:test", "--no-peak", "--target", "cpu"]
    paths = [layer["layer"] for layer in json.loads(run(capsys, *argv, "--format", "json"))["layers"]]
    assert len(paths) > 25 and any(p.count(".") == 2 for p in paths)  # JSON: every module path by default
    assert _layer_names(run(capsys, *argv, "--depth", "all")) == paths
    default = run(capsys, *argv)
    assert len(_layer_names(default)) <= 25 and not any(p.count(".") == 2 for p in _layer_names(default))
    assert f"--depth all lists all {len(paths)}." in default


def test_a_bad_depth_is_one_line_naming_the_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", MLP, "--depth", "foo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --depth: 'foo' is neither a whole number nor 'all'" in err


def test_top_names_the_share_of_the_k_largest(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "analyze", MLP, "--top", "3")
    match = re.search(r"^3 layers hold (\d+\.\d)% of activation memory at B=32\.$", out, re.M)
    assert match and 0 < float(match.group(1)) <= 100


def test_zoo_lists_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "zoo")
    listed = {line.split()[0] for line in out.splitlines()[2:] if line.strip()}
    assert listed == set(ZOO)


def test_measure_is_exact_on_the_mlp(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "measure", MLP, "--batch", "2")
    assert re.search(r"Activations at B=2: measured (\d+) B, predicted \1 B: exact\.", out)


def test_leaf_keeps_attention_as_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    report = json.loads(run(capsys, "analyze", "tests/models_for_errors.py:attention", "--leaf", "MultiheadAttention", "--format", "json"))
    assert [n["target"] for n in report["nodes"] if n["layer"] == "attn"] == ["MultiheadAttention"]


@pytest.mark.parametrize("argv", [["--help"], ["analyze", "--help"], ["measure", "--help"], ["timeline", "--help"]])
def test_help_warns_that_loading_runs_code(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    out = run(capsys, *argv)
    assert "RUNS that code with your permissions" in " ".join(out.split())


def test_analyze_reports_its_stages() -> None:
    spec = load_model(MLP)
    stages: list[str] = []
    analyze(spec.model, spec.inputs, loss=spec.loss, progress=stages.append, target="cpu")
    assert stages == [
        "tracing the model",
        "simulating the training step and its saved tensors (symbolic pass, batch B)",
        "simulating the training step and its saved tensors (concrete pass at B=1)",
        "counting model state",
        "simulating the training step (symbolic pass, batch B)",
    ]  # the saved tensors are the step's (Note [One pass for the capture and the step]); its timeline is taken after the state



def test_analyze_without_the_step_reports_the_capture_passes() -> None:
    spec = load_model(MLP)
    stages: list[str] = []
    analyze(spec.model, spec.inputs, loss=spec.loss, progress=stages.append, target="cpu", peak=False)
    assert stages == [
        "tracing the model",
        "capturing saved tensors (symbolic pass, batch B)",
        "capturing saved tensors (concrete pass at B=1)",
        "counting model state",
    ]

class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_on_a_terminal_is_one_line_erased_at_the_end() -> None:
    stream = _Stream(tty=True)
    progress = cli._Progress(stream)
    progress("tracing with torch.fx")
    progress("counting model state")
    progress.close()
    assert stream.getvalue() == "\r\x1b[Kfxmem: tracing with torch.fx...\r\x1b[Kfxmem: counting model state...\r\x1b[K"


def test_progress_elsewhere_only_for_slow_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_SLOW_S", 0.05)
    stream = _Stream(tty=False)
    progress = cli._Progress(stream)
    progress("quick")
    progress("slow")  # cancels 'quick' before its timer fires
    deadline = time.monotonic() + 10
    while not stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    progress.close()
    assert stream.getvalue() == "fxmem: slow...\n"


def test_the_training_setup_reaches_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["analyze", MLP, "--format", "json", "--gpu", "a100-80gb", "--amp", "bf16", "--precision", "mixed"]
    argv += ["--world-size", "8", "--shard", "zero3", "--optimizer-impl", "fused", "--overhead", "cuda_context=1GiB"]
    report = json.loads(run(capsys, *argv))
    assert report["target"] == {
        "target": "cuda", "gpu": "a100-80gb", "amp": "bf16", "precision": "mixed", "world_size": 8, "shard": "zero3", "optimizer_impl": "fused",
        "torch_version": None, "alloc_conf": "", "memory_fraction": None,
    }  # fmt: skip
    device = report["peak"]["steady_step"]["device"]
    assert device["overheads"]["cuda_context"] == 2**30
    # the 1 GiB context as given, and cuBLAS's kernel modules (no cuDNN: an MLP runs no convolution)
    assert device["nvidia_smi_total"] == device["max_memory_reserved"] + 2**30 + CUBLAS_KERNELS_BYTES
    assert report["device_memory"] == 81920 * 2**20  # the A100 80GB as nvidia-smi shows it, the default budget
    assert report["per_gpu_state"]["master"] == -(-report["model_state"]["trainable_parameters"] * 4 // 8)


def test_the_cpu_target_keeps_the_cpu_report(capsys: pytest.CaptureFixture[str]) -> None:
    text = run(capsys, "analyze", MLP, "--target", "cpu")
    assert "target: cpu, precision fp32" in text and "nvidia-smi" not in text


def test_measure_peak_of_a_cuda_target_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["measure", MLP, "--peak", "--target", "cuda", "--batch", "2"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_device_memory_needs_a_unit(capsys: pytest.CaptureFixture[str]) -> None:
    # '--device-memory 80' once meant 80 bytes (issue 35); now it is an error that says what to write.
    assert cli.main(["analyze", MLP, "--device-memory", "80"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("fxmem: error: ") and err.count("\n") == 1, err
    assert "--device-memory '80' has no unit" in err and "80GiB" in err and "80GB" in err


def test_a_described_gpu_reaches_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = "memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=51"
    report = json.loads(run(capsys, "analyze", MLP, "--format", "json", "--gpu", gpu))
    assert report["target"]["gpu"] == gpu
    assert report["device_memory"] == 12 * 2**30  # the described memory is the default budget, as a named GPU's is


def test_a_bad_gpu_description_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", MLP, "--gpu", "memory=12GiB,cc=8.6,fp32=12.7"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "lacks bandwidth" in err and "memory, cc, bandwidth and fp32" in err


def test_sizes_need_a_unit_except_zero() -> None:
    # The rule --device-memory, plan --memory and --overhead NAME=SIZE share (fxmem.inputs.parse_size).
    from fxmem.errors import InputSpecError
    from fxmem.inputs import parse_size

    assert parse_size("80GiB") == 80 * 2**30 and parse_size("24 GB") == 24 * 10**9 and parse_size(512) == 512
    assert parse_size("0.3GB") == 300_000_000  # exact: 0.3 x 10^9, not 299,999,999
    assert parse_size("0", "--overhead cuda_context", allow_zero=True) == 0  # 0 needs no unit
    with pytest.raises(InputSpecError, match="'80' has no unit"):
        parse_size("80", "--memory")
    with pytest.raises(InputSpecError, match="'0' is 0 bytes; give a positive size"):
        parse_size("0", "--memory")
