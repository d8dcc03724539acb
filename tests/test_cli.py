"""The happy paths of the ``fxmem`` command line, through ``fxmem.cli.main`` as the script runs it."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fxmem
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
    rows = rows[rows.index([]) + 1 :]  # the layer table follows the summary rows and an empty row
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


# --- issue 36: a parser without torch, usage errors that name the nearest option, quiet runs ------------
def _python(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def test_the_parser_imports_no_torch() -> None:
    """--help, --version and a usage error answer without importing torch (Note [A parser without torch]);
    benchmarks/cli_speed.py times them."""
    check = "import sys, fxmem, fxmem.cli; fxmem.cli._parser().format_help(); assert 'torch' not in sys.modules, 'torch'"
    done = _python("-c", check)
    assert done.returncode == 0, done.stderr
    version = _python("-m", "fxmem", "--version")
    assert version.returncode == 0 and version.stdout.startswith(f"fxmem {fxmem.__version__} (torch "), version
    assert "not imported" in version.stdout


def test_the_parser_choices_equal_the_registries() -> None:
    """Each torch-free copy in fxmem.choices equals the registry it names, so that neither changes alone."""
    import torch

    from fxmem import choices
    from fxmem.cost.tradeoff import BN_THRESHOLD
    from fxmem.engine.losses import LOSSES
    from fxmem.frontends.tracing import FRONTENDS
    from fxmem.gpu.gpus import GPUS
    from fxmem.output.render import FORMATS, MAX_ROWS
    from fxmem.parallel.pipeline_split import Schedule
    from fxmem.planner.search import DEFAULT_LEVERS, LEVERS
    from fxmem.rules.optimizers import IMPLS, OPTIMIZERS
    from fxmem.results import ZERO_GRAD_PLACES
    from fxmem.step.precision import RECIPES
    from fxmem.step.training import AMP_DTYPES, DEFAULT_GPU, SHARDS, TARGETS

    assert choices.LOSSES == tuple(LOSSES) and choices.FRONTENDS == tuple(FRONTENDS) and choices.GPUS == tuple(GPUS)
    assert choices.DEFAULT_GPU == DEFAULT_GPU and choices.TARGETS == tuple(TARGETS) and choices.AMP_DTYPES == tuple(AMP_DTYPES)
    assert choices.SHARDS == tuple(SHARDS) and choices.IMPLS == tuple(IMPLS) and choices.OPTIMIZERS == tuple(OPTIMIZERS.rules())
    assert choices.RECIPES == {name: r.summary for name, r in RECIPES.items()}
    assert choices.BF16_WEIGHT_RECIPES == tuple(name for name, r in RECIPES.items() if r.weight_dtype == torch.bfloat16)
    assert choices.FORMATS == tuple(FORMATS) and choices.MAX_ROWS == MAX_ROWS and choices.BN_THRESHOLD == BN_THRESHOLD
    assert choices.LEVERS == tuple(LEVERS) and choices.DEFAULT_LEVERS == tuple(DEFAULT_LEVERS)
    assert sorted(choices.SCHEDULES) == sorted(s.value for s in Schedule) and choices.SCHEDULES[0] == "1f1b"
    assert choices.ZERO_GRAD_PLACES == ZERO_GRAD_PLACES


def test_the_package_exports_every_name_lazily() -> None:
    assert set(fxmem.__all__) == {*fxmem._MODULE_OF, "__version__"}
    for name in fxmem.__all__:
        assert getattr(fxmem, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        fxmem.nothing  # noqa: B018


def test_a_mistyped_option_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", "zoo:resnet50", "--bach", "8"]) == 2
    assert capsys.readouterr().err == "fxmem: error: unrecognized argument --bach; did you mean --batch? see 'fxmem analyze --help'.\n"
    assert cli.main(["timeline", MLP, "--frist-step"]) == 2
    assert "unrecognized argument --frist-step; did you mean --first-step? see 'fxmem timeline --help'." in capsys.readouterr().err
    assert cli.main(["analyze", MLP, "--zzzzzz=1"]) == 2  # nothing near: no suggestion
    assert capsys.readouterr().err == "fxmem: error: unrecognized argument --zzzzzz; see 'fxmem analyze --help'.\n"
    assert cli.main(["analyze", MLP, "stray"]) == 2
    assert capsys.readouterr().err == "fxmem: error: unrecognized arguments: stray; see 'fxmem analyze --help'.\n"


def test_a_mistyped_command_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyse", MLP]) == 2
    err = capsys.readouterr().err
    assert err == (
        "fxmem: error: argument COMMAND: invalid choice: 'analyse' (choose from analyze, measure, timeline, plan, zoo); "
        "did you mean analyze? see 'fxmem --help'.\n"
    )
    assert cli.main(["timelin", MLP]) == 2
    assert "did you mean timeline?" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["analyze", "measure", "timeline"])
def test_help_lists_the_common_options_first(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = run(capsys, command, "--help")
    titles = ["\nmodel and inputs:", "\nbatch", "\ntraining setup:", "\nparallelism:", "\nadvanced:"]
    assert [text.index(t) for t in titles] == sorted(text.index(t) for t in titles)
    order = ["--input", "--batch", "--gpu", "--amp", "--fsdp", "--frontend", "--alloc-conf"]
    assert [text.index(f"  {o} ") for o in order] == sorted(text.index(f"  {o} ") for o in order)
    assert "-v, --verbose" in text


def test_analyze_help_puts_the_verdict_options_before_the_setup(capsys: pytest.CaptureFixture[str]) -> None:
    text = run(capsys, "analyze", "--help")
    verdict = text[text.index("batch, device, verdict and output:") : text.index("training setup:")]
    for option in ("--batch", "--gpu", "--device-memory", "--check", "--format", "--html"):
        assert f"  {option} " in verdict, option


def test_an_unwritable_output_fails_before_the_analysis(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("the analysis ran")

    monkeypatch.setattr(cli, "analyze", never)
    assert cli.main(["analyze", MLP, "--html", "/no/such/dir/x.html"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--html: cannot write the page to '/no/such/dir/x.html'" in err
    assert "'/no/such/dir' does not exist" in err
    assert cli.main(["analyze", MLP, "--plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the picture (--plot) to '{tmp_path}': it is a folder" in err
    assert cli.main(["timeline", MLP, "--plot", "/no/such/dir/t.png"]) == 2
    assert "cannot write the picture (--plot) to '/no/such/dir/t.png'" in capsys.readouterr().err


def test_json_keeps_stdout_to_the_report_and_says_what_it_wrote_on_stderr(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "x.html"
    assert cli.main(["analyze", MLP, "--target", "cpu", "--batch", "4", "--format", "json", "--html", str(page)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["model"] == MLP and page.read_text(encoding="utf-8").startswith("<!")
    assert err == f"fxmem: wrote {page}\n"


_NOISY = '''
import logging
import warnings

from torch import nn

from fxmem.results import ModelSpec


class Noisy(nn.Linear):
    def forward(self, x):
        logging.getLogger("torch.fx.experimental.symbolic_shapes").warning("Unable to find user code corresponding to {u0}")
        warnings.warn("torch.old_api is deprecated", FutureWarning)
        warnings.warn("fully_shard: a UserWarning of torch's", UserWarning)
        return super().forward(x)


def model():
    return ModelSpec(Noisy(8, 8), ["B,8"], "sum")
'''


def test_torch_logs_and_warnings_show_only_with_verbose(tmp_path: Path) -> None:
    """torch's log lines ('W1205 ... Unable to find user code corresponding to {u0}', as symbolic_shapes
    logs them under torch.export), FutureWarnings and UserWarnings are held back; fxmem's notes are not."""
    (tmp_path / "noisy.py").write_text(_NOISY)
    argv = ["-m", "fxmem", "analyze", "noisy.py:model", "--target", "cpu", "--no-peak", "--world-size", "2", "--format", "json"]
    for frontend in ("export", "fx"):
        quiet = _python(*argv, "--frontend", frontend, cwd=tmp_path)
        assert quiet.returncode == 0, quiet.stderr
        json.loads(quiet.stdout)
        lines = quiet.stderr.splitlines()
        assert [line for line in lines if line.startswith("fxmem: note: ")] and all(line.startswith("fxmem: ") for line in lines), quiet.stderr
    loud = _python(*argv, "--frontend", "fx", "-v", cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr
    assert re.search(r"^W\d{4} .*Unable to find user code corresponding to \{u0\}$", loud.stderr, re.M), loud.stderr
    assert "FutureWarning: torch.old_api is deprecated" in loud.stderr and "UserWarning: fully_shard" in loud.stderr
    assert "fxmem: note: " in loud.stderr
