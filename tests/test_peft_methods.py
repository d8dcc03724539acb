"""Every PEFT method peft has, analyzed as its own real CPU step runs (issue 40, point 5).

Each method is put on the same tiny Llama (peft's method comparison runs Llama-3.2-3B; the code paths
are the same), targeting q_proj and v_proj where it takes targets, as ``task_type="CAUSAL_LM"``; truth
is a real CPU step of the same model: ``fxmem.measure`` (saved bytes, to the byte) and
``fxmem.measure_peak`` (the step's peak, within 1%).

The default run checks one method per way the methods differ for fxmem (a custom autograd.Function, a
random draw, a check on weights, ``.data``, a sparse tensor, a prompt cache, a value nothing reads...),
a few seconds each; ``FXMEM_PEFT_METHODS=all`` checks every method (about 4 minutes on one core).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import FxmemWarning, LoadError, TraceError
from fxmem.frontends import off_meta
from fxmem.frontends.load import load_model
from fxmem.frontends.random_structure import RandomStructure

transformers = pytest.importorskip("transformers", reason="PEFT methods are checked on a Hugging Face Llama")
peft = pytest.importorskip("peft", reason="PEFT methods need the peft package")
transformers.logging.set_verbosity_error()

INPUTS = {"input_ids": "B,16:int64", "labels": "B,16:int64"}
TARGETS = ["q_proj", "v_proj"]

# method -> (peft config class, its arguments, the inputs' extra specs); targets and the task are added
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "lora": ("LoraConfig", {"r": 8, "lora_alpha": 16}),
    "dora": ("LoraConfig", {"r": 8, "lora_alpha": 16, "use_dora": True}),
    "rslora": ("LoraConfig", {"r": 8, "lora_alpha": 16, "use_rslora": True}),
    "pissa": ("LoraConfig", {"r": 8, "lora_alpha": 16, "init_lora_weights": "pissa"}),
    "olora": ("LoraConfig", {"r": 8, "lora_alpha": 16, "init_lora_weights": "olora"}),
    "adalora": ("AdaLoraConfig", {"init_r": 8, "target_r": 4, "total_step": 10}),
    "adamss": ("AdamssConfig", {}),
    "boft": ("BOFTConfig", {"boft_block_size": 4}),
    "c3a": ("C3AConfig", {"block_size": 16}),
    "delora": ("DeloraConfig", {}),
    "fourierft": ("FourierFTConfig", {"n_frequency": 100}),
    "glora": ("GloraConfig", {}),
    "gralora": ("GraloraConfig", {}),
    "hira": ("HiraConfig", {}),
    "hra": ("HRAConfig", {"r": 8}),
    "ia3": ("IA3Config", {"target_modules": ["k_proj", "v_proj", "down_proj"], "feedforward_modules": ["down_proj"]}),
    "lily": ("LilyConfig", {}),
    "ln_tuning": ("LNTuningConfig", {"target_modules": None}),
    "loha": ("LoHaConfig", {"r": 8, "alpha": 16}),
    "lokr": ("LoKrConfig", {"r": 8, "alpha": 16}),
    "miss": ("MissConfig", {"r": 8}),
    "miss-bat": ("MissConfig", {"r": 8, "init_weights": "bat"}),
    "oft": ("OFTConfig", {"r": 0, "oft_block_size": 16}),
    "osf": ("OSFConfig", {}),
    "peanut": ("PeanutConfig", {}),
    "psoft": ("PsoftConfig", {}),
    "pvera": ("PveraConfig", {"r": 8}),
    "randlora": ("RandLoraConfig", {"r": 8}),
    "road": ("RoadConfig", {"group_size": 16}),
    "shadow": ("ShadowConfig", {"target_modules": None}),
    "shira": ("ShiraConfig", {"r": 8}),
    "supertuning": ("SupertuningConfig", {}),
    "tinylora": ("TinyLoraConfig", {}),
    "trainable-tokens": ("TrainableTokensConfig", {"token_indices": [0, 1, 2], "target_modules": None}),
    "unilora": ("UniLoraConfig", {}),
    "vblora": ("VBLoRAConfig", {"r": 4, "num_vectors": 32, "vector_length": 16}),
    "vera": ("VeraConfig", {"r": 8}),
    "beft": ("BeftConfig", {}),
    "deft": ("DeftConfig", {}),
    "poly": ("PolyConfig", {"r": 8, "n_tasks": 1}),
    "prefix-tuning": ("PrefixTuningConfig", {"num_virtual_tokens": 4}),
    "prompt-tuning": ("PromptTuningConfig", {"num_virtual_tokens": 4}),
    "p-tuning": ("PromptEncoderConfig", {"num_virtual_tokens": 4, "encoder_hidden_size": 32}),
    "multitask-prompt-tuning": ("MultitaskPromptTuningConfig", {"num_virtual_tokens": 4, "num_tasks": 1}),
    "adaption-prompt": ("AdaptionPromptConfig", {"adapter_len": 4, "adapter_layers": 1}),
    "cartridge": ("CartridgeConfig", {"num_virtual_tokens": 4}),
}
NEEDS_TASK_IDS = {"poly", "multitask-prompt-tuning"}
"""Multi-task methods whose forward takes ``task_ids`` (one task id per sample)."""
NO_TARGETS = {"ln_tuning", "shadow", "trainable-tokens", "prefix-tuning", "prompt-tuning", "p-tuning", "multitask-prompt-tuning", "adaption-prompt", "cartridge"}
"""Methods that adapt no q_proj/v_proj: norms, whole decoder blocks, embeddings, virtual tokens."""

DEFAULT = ("lora", "loha", "vblora", "hra", "shira", "c3a", "miss-bat", "poly", "prefix-tuning", "shadow")
"""One method per way they differ for fxmem: LoRA; LoHa's autograd.Function and its draw against
``module_dropout`` (Notes [A custom autograd.Function in an exported graph], [A random draw compared with a
bound it cannot cross]); VB-LoRA's check that raises and Poly's on ``.item()`` (Note [A check that raises]);
HRA's and MiSS-bat's ``.data`` (Note [.data while exporting]); SHiRA's sparse weight (Notes [A sparse
tensor's storages], [sparse_mask on fake tensors]); C3A's Function on the input's path; prefix tuning's cache
(Note [The cache a training forward builds]); ShadowPEFT's unread state (Note [A value nothing reads])."""

LEFT = {
    "frod": "FRoD sizes its sparse S from a buffer's values (frod/layer.py: size = tuple(... frod_s_size[adapter].tolist())) and "
    "coalesces it (nnz known only from the data): no trace stands for it; fxmem refuses with the line",
    "waveft": "WaveFT keeps the entries of its index table that fall inside the padded spectrum (a boolean mask, "
    "waveft/layer.py: valid_indices = padded_indices[:, valid_mask]): a count only its values give, reported as "
    "unsupported and counted 0 B (16 B per index short)",
    "cpt": "CPT projects its delta embeddings only if some row has a nonzero norm (cpt/model.py: if torch.any(projection_mask)), "
    "a branch on weights that is no check; fxmem refuses with the line",
}
"""Methods fxmem does not analyze exactly yet, and why: run with FXMEM_PEFT_METHODS=all, each expected to fail as said."""
CANNOT_RUN = {
    "xlora": "X-LoRA mixes LoRA adapters trained beforehand, loaded from their saved paths (XLoraConfig.adapters); there are none to load here",
}


def _selected() -> list[Any]:
    everything = os.environ.get("FXMEM_PEFT_METHODS", "") == "all"
    names = list(METHODS) if everything else list(DEFAULT)
    params = [pytest.param(n, id=n) for n in names]
    params += [pytest.param(n, id=n, marks=pytest.mark.skip(reason=why)) for n, why in CANNOT_RUN.items()]
    if everything:
        params += [pytest.param(n, id=n, marks=pytest.mark.xfail(reason=why, strict=True)) for n, why in LEFT.items()]
    return params


def _llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(dtype)


def _config(method: str) -> Any:
    kind, arguments = {
        **METHODS,
        "frod": ("FrodConfig", {}),
        "waveft": ("WaveFTConfig", {"n_frequency": 64}),
        "cpt": ("CPTConfig", {"cpt_token_ids": [0, 1, 2], "cpt_mask": [1, 1, 1], "cpt_tokens_type_mask": [1, 2, 2]}),
    }[method]
    config_class = getattr(peft, kind, None)
    if config_class is None:
        pytest.skip(f"peft {peft.__version__} has no {kind}")
    if method == "adamss":
        pytest.importorskip("sklearn", reason="peft's AdaMSS clusters with scikit-learn")
    targets = {} if method in NO_TARGETS or "target_modules" in arguments else {"target_modules": TARGETS}
    arguments = {k: v for k, v in arguments.items() if not (k == "target_modules" and v is None)}
    return config_class(task_type="CAUSAL_LM", **targets, **arguments)


def _peft_model(method: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return peft.get_peft_model(_llama(dtype), _config(method))


def _inputs(method: str) -> dict[str, str]:
    return {**INPUTS, "task_ids": "B:int64"} if method in NEEDS_TASK_IDS else INPUTS


def _held_to_real(model: nn.Module, inputs: dict[str, str]) -> fxmem.Report:
    report = fxmem.analyze(model, inputs, loss="auto", target="cpu", batch=2)
    assert report.activation_bytes(2) == fxmem.measure(model, inputs, 2, loss="auto").total
    real = fxmem.measure_peak(model, inputs, 2, loss="auto").bytes
    assert report.peak(2).bytes == pytest.approx(real, rel=0.01)
    return report


@pytest.mark.parametrize("method", _selected())
def test_a_peft_method_is_analyzed_as_its_real_step_runs(method: str) -> None:
    model = _peft_model(method)
    report = _held_to_real(model, _inputs(method))
    assert report.state.trainable == model.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("method", ["loha", "shira"])
def test_a_bf16_base_as_peft_s_method_comparison_runs_it(method: str) -> None:
    # Llama-3.2-3B in bf16 with fp32 adapters (peft's autocast_adapter_dtype): LoHa's Function casts its
    # factors, SHiRA adds an fp32 sparse delta to a bf16 weight
    _held_to_real(_peft_model(method, torch.bfloat16), INPUTS)


# --- the rules behind them, each on a model of a few lines -------------------------------------------


class _Hada(torch.autograd.Function):
    """LoHa's HadaWeight: keeps its four factors, recomputes the products in backward."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, c, d)
        return (a @ b) * (c @ d)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b, c, d = ctx.saved_tensors
        left, right = grad * (c @ d), grad * (a @ b)
        return left @ b.T, a.T @ left, right @ d.T, c.T @ right


class _HadaLinear(nn.Module):
    def __init__(self, features: int = 32, rank: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.factors = nn.ParameterList([nn.Parameter(torch.randn(s) * 0.1) for s in ((features, rank), (rank, features)) * 2])
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand(1) > self.dropout:  # LoHa's module_dropout: always at 0
            x = x @ _Hada.apply(*self.factors)
        return x.relu()


def test_a_custom_function_saves_what_its_ctx_saves() -> None:
    # the factors are parameters, so only the relu's output is saved, 4 x 32 x 4 B; exported through, the
    # Function's two 32 x 32 products would be too: Note [A custom autograd.Function in an exported graph]
    report = fxmem.analyze(_HadaLinear(), ["B,32"], batch=4, target="cpu", frontend="export")
    assert report.activation_bytes(4) == fxmem.measure(_HadaLinear(), ["B,32"], 4).total == 4 * 32 * 4


def test_a_draw_against_a_bound_it_cannot_cross_is_no_random_structure() -> None:
    # Note [A random draw compared with a bound it cannot cross]: rand > 0 holds in every step; rand > 0.3 does not
    fxmem.analyze(_HadaLinear(dropout=0.0), ["B,32"], batch=4, target="cpu", frontend="export", peak=False)
    with pytest.raises(RandomStructure, match="branches on a random number"):
        fxmem.analyze(_HadaLinear(dropout=0.3), ["B,32"], batch=4, target="cpu", frontend="export", peak=False)


class _Checked(nn.Module):
    """A layer that checks its weight in training (VB-LoRA's isinf check) and reads ``.data`` (HRA's)."""

    def __init__(self, raises: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.raises = raises

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.raises:
            if self.training and self.lin.weight[0].isinf().any():
                raise RuntimeError("infinite weights")
        elif self.lin.weight.sum() > 0:  # a branch on a value that guards no raise: still refused
            x = x * 2
        return nn.functional.linear(x.relu(), self.lin.weight.data * 0.5 + self.lin.weight, self.lin.bias)


def test_a_check_that_raises_is_taken_as_passing_and_data_as_detach() -> None:
    # Notes [A check that raises], [.data while exporting]
    report = fxmem.analyze(_Checked(), ["B,32"], batch=4, target="cpu", frontend="export")
    assert report.activation_bytes(4) == fxmem.measure(_Checked(), ["B,32"], 4).total
    with pytest.raises(TraceError, match=r"branches on a tensor's value .*weight.sum"):
        fxmem.analyze(_Checked(raises=False), ["B,32"], batch=4, target="cpu", frontend="export", peak=False)


# --- models that cannot be built on the meta device ----------------------------------------------

FACTORY = '''
import peft, transformers
transformers.logging.set_verbosity_error()


def build():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    lora = peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return peft.get_peft_model(transformers.LlamaForCausalLM(config), lora), {"input_ids": "B,16:int64", "labels": "B,16:int64"}


def broken():
    raise ValueError("a bug of the factory's own")
'''


@pytest.fixture
def factory(tmp_path: Path) -> str:
    path = tmp_path / "boft_llama.py"
    path.write_text(FACTORY)
    return str(path)


def test_a_model_the_meta_device_cannot_build_is_built_on_the_cpu(factory: str) -> None:
    # Note [A factory that needs real values]: BOFT's permutation matrices index with tensors (.item() on meta)
    with pytest.warns(FxmemWarning, match=r"cannot be built on the meta device \(peft/tuners/boft/layer.py:\d+: Tensor.item\(\) cannot be called on meta tensors\).*at its real size"):
        spec = load_model(f"{factory}:build")
    assert {p.device.type for p in spec.model.parameters()} == {"cpu"}
    report = fxmem.analyze(spec.model, spec.inputs, loss="auto", target="cpu", batch=2, peak=False)
    by_hand = fxmem.analyze(_peft_model("boft"), INPUTS, loss="auto", target="cpu", batch=2, peak=False)  # built on the CPU by the user
    assert (report.activation_bytes(2), report.state) == (by_hand.activation_bytes(2), by_hand.state)


def test_a_large_model_is_built_with_its_init_skipped(factory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(off_meta, "_REAL_INIT_BYTES", 0)
    initializers = [getattr(torch.nn.init, f) for f in off_meta._INIT_FUNCTIONS]
    with pytest.warns(FxmemWarning, match="with torch.nn.init's initializers skipped"):
        spec = load_model(f"{factory}:build")
    assert type(spec.model).__name__ == "PeftModelForCausalLM"
    assert [getattr(torch.nn.init, f) for f in off_meta._INIT_FUNCTIONS] == initializers


def test_a_factory_s_own_error_is_not_tried_on_the_cpu(factory: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxmemWarning)
        with pytest.raises(LoadError, match=r"the factory raised ValueError: a bug of the factory's own\.$"):
            load_model(f"{factory}:broken")

