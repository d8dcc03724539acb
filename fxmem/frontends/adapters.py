"""PEFT models as users pass them: the module whose forward a ``PeftModel`` really runs.

Note [A bare PeftModel]
    ``peft.get_peft_model(model, config)`` with a config that names no ``task_type`` returns a plain
    ``PeftModel`` (several PEFT methods' examples build it so). Its forward (peft 0.21,
    peft_model.py, ``PeftModel.forward``) is ``with self._enable_peft_forward_hooks(*args, **kwargs):
    return self.get_base_model()(*args, **kwargs)`` after dropping ``adapter_names`` and
    ``alora_offsets``; the hooks context does nothing unless one of those two arguments is passed
    (tuners/lora/model.py, ``LoraModel._enable_peft_forward_hooks``: "nothing to do"). The adapters
    themselves are already inside the base model: ``inject_adapter`` replaced its target layers. So
    the step of a bare ``PeftModel`` is the step of ``get_base_model()``, the same parameters, frozen
    and trainable as peft left them. torch.fx cannot trace the hooks' context manager and
    torch.export cannot give dynamic shapes to a ``*args, **kwargs`` forward ("Must provide a
    tree_name when there might be a mismatch"), so fxmem traces, simulates and measures the base
    model. The task-specific classes (``PeftModelForCausalLM``...) override forward and are left
    whole: theirs add what prompt learning needs (virtual tokens, a prefix cache) around the base
    model's call.

Note [A PEFT model under the bf16 recipe]
    People fine-tune with the base loaded in bf16 (``from_pretrained(..., dtype=torch.bfloat16)``) and
    the adapter in fp32: ``get_peft_model(..., autocast_adapter_dtype=True)``, the default, upcasts
    every adapter weight that is fp16 or bf16 to fp32 (peft 0.21, tuners/tuners_utils.py,
    ``BaseTuner._cast_adapter_dtype``), so the optimizer, its state and the gradients are fp32 while the
    frozen base computes in bf16 (the LoRA layer casts its input to the adapter's dtype and the result
    back). ``--precision bf16`` for a PEFT model is therefore that run, not ``model.to(torch.bfloat16)``:
    the frozen floating weights are held in bf16 and every trainable one keeps the dtype peft gave
    it; the state is then counted per parameter, as built. The other recipes (a master copy of bf16
    adapters) are not what peft does and keep their meaning.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from torch import nn

from fxmem.errors import InputSpecError, LoadError

__all__ = ["LoraOptions", "add_lora", "forward_module", "is_peft_model"]


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (of any task); peft is never imported here."""
    peft_model = sys.modules.get("peft.peft_model")  # imported with any PeftModel
    base = getattr(peft_model, "PeftModel", None)
    return isinstance(base, type) and isinstance(model, base)


def forward_module(model: nn.Module) -> nn.Module:
    """The module whose forward ``model``'s forward runs: a bare ``PeftModel``'s base model (Note [A bare
    PeftModel]), else ``model`` itself."""
    base = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    if isinstance(base, type) and isinstance(model, base) and type(model).forward is base.forward:
        return model.get_base_model()  # type: ignore[no-any-return,operator]
    return model


@dataclass(frozen=True)
class LoraOptions:
    """What ``--lora r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05`` asks for: peft's ``LoraConfig``
    fields ``r``, ``lora_alpha``, ``target_modules`` and ``lora_dropout``, with peft's defaults (r 8,
    alpha 8, the targets peft picks for the model's type, no dropout)."""

    r: int = 8
    alpha: float = 8
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    dora: bool = False

    @staticmethod
    def parse(text: str) -> LoraOptions:
        """``KEY=VALUE`` pairs split by commas; a part without ``=`` adds one more name to ``targets``."""
        fields: dict[str, list[str]] = {}
        key = ""
        for part in (p.strip() for p in text.split(",")):
            name, eq, value = part.partition("=")
            if eq:
                key = name.strip()
                if key not in _LORA_KEYS:
                    raise InputSpecError(f"--lora '{text}': unknown key '{key}'; use {', '.join(_LORA_KEYS)}, e.g. --lora r=16,alpha=32,targets=q_proj,v_proj.")
                fields[key] = [value.strip()]
            elif key == "targets" and part:
                fields[key].append(part)
            else:
                raise InputSpecError(f"--lora '{text}': '{part}' is not KEY=VALUE; write e.g. --lora r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05.")
        return LoraOptions(
            r=_number(fields, "r", int, text, 8), alpha=_number(fields, "alpha", float, text, 8), targets=tuple(fields.get("targets", ())),
            dropout=_number(fields, "dropout", float, text, 0.0), dora=fields.get("dora", ["false"])[0].lower() in ("1", "true", "yes"),
        )  # fmt: skip

    def describe(self) -> str:
        targets = ",".join(self.targets) if self.targets else "peft's default targets"
        return f"{'DoRA' if self.dora else 'LoRA'} r={self.r} alpha={self.alpha:g} on {targets}" + (f" dropout={self.dropout:g}" if self.dropout else "")


_LORA_KEYS = ("r", "alpha", "targets", "dropout", "dora")


def _number(fields: dict[str, list[str]], key: str, kind: type, text: str, default: Any) -> Any:
    if key not in fields:
        return default
    try:
        value = kind(fields[key][0])
    except ValueError:
        raise InputSpecError(f"--lora '{text}': {key}={fields[key][0]} is not a number; e.g. r=16, alpha=32, dropout=0.05.") from None
    if value < 0 or (key == "r" and value == 0) or (key == "dropout" and value >= 1):
        raise InputSpecError(f"--lora '{text}': {key}={fields[key][0]} is out of range (r >= 1, alpha >= 0, 0 <= dropout < 1).")
    return value


_TASKS = (("ForCausalLM", "CAUSAL_LM"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM"), ("ForSeq2SeqLM", "SEQ_2_SEQ_LM"),
          ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"), ("ForQuestionAnswering", "QUESTION_ANS"))  # fmt: skip
"""peft's task type for a transformers head, as a fine-tuning script names it: the class name's ending."""


def add_lora(model: nn.Module, options: LoraOptions, name: str) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))`` as a fine-tuning script calls it, with peft's
    ``autocast_adapter_dtype`` (fp32 adapters over a bf16 base: Note [A PEFT model under the bf16
    recipe]); the task type follows the model's head (``LlamaForCausalLM`` -> ``CAUSAL_LM``)."""
    try:
        import peft
    except ImportError as e:
        raise LoadError(f"model '{name}': --lora builds the adapter with the peft package, which is not installed: pip install peft (or pip install 'fxmem[hf]').") from e
    task = next((t for ending, t in _TASKS if type(model).__name__.endswith(ending)), None)
    config = peft.LoraConfig(
        r=options.r, lora_alpha=options.alpha, target_modules=list(options.targets) or None, lora_dropout=options.dropout,
        use_dora=options.dora, task_type=task,
    )  # fmt: skip
    try:
        return peft.get_peft_model(model, config)  # type: ignore[no-any-return]
    except Exception as e:  # peft's own refusal (an unknown target, a layer type it cannot adapt), in one line
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise LoadError(
            f"model '{name}': peft cannot add {options.describe()} ({first}); name modules the model has in targets= "
            "(their last name, e.g. q_proj), or 'all-linear'."
        ) from e
