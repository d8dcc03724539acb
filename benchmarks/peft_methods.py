"""What fine-tuning a Llama-3.2-3B costs on an L40S, by PEFT method: issue 40's benchmark.

The config is Llama-3.2-3B's (benchmarks/configs/llama-3.2-3b.json, no weights), built on the meta
device in bf16 as ``from_pretrained(..., dtype=torch.bfloat16)`` loads it, at 4 sequences of 768
tokens, AdamW, on an L40S (48 GB). Full fine-tuning holds everything in bf16 (``--precision bf16``);
each adapter is added with peft as a fine-tuning script adds it (its weights fp32, the base frozen).
The config keeps ``use_cache: true``, as the published one does, so transformers builds its cache in
the training forward (Note [The cache a training forward builds]); ``--no-cache`` turns it off.

Each row: what the GPU must hold (nvidia-smi's total) for a steady step, its tensor peak, the
trainable parameters, whether B=4 fits, and the seconds the analysis took on this machine (model
construction and peft included). A method peft cannot build here is listed with its reason.

    python benchmarks/peft_methods.py            # every method
    python benchmarks/peft_methods.py lora ia3   # some
    python benchmarks/peft_methods.py --no-cache
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CONFIG = Path(__file__).parent / "configs" / "llama-3.2-3b.json"
BATCH, TOKENS, GPU = 4, 768, "l40s"
TARGETS = ["q_proj", "v_proj"]


def _methods(peft: Any) -> dict[str, Callable[[], Any] | None]:
    """peft configs as the method comparison's defaults would make them (None: full fine-tuning)."""
    task = "CAUSAL_LM"
    return {
        "full": None,
        "lora": lambda: peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type=task),
        "dora": lambda: peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, use_dora=True, task_type=task),
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"], task_type=task),
        "adalora": lambda: peft.AdaLoraConfig(init_r=16, target_r=8, total_step=1000, target_modules=TARGETS, task_type=task),
        "loha": lambda: peft.LoHaConfig(r=16, alpha=32, target_modules=TARGETS, task_type=task),
        "lokr": lambda: peft.LoKrConfig(r=16, alpha=32, target_modules=TARGETS, task_type=task),
        "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=TARGETS, task_type=task),
        "prefix": lambda: peft.PrefixTuningConfig(num_virtual_tokens=32, task_type=task),
        "prompt": lambda: peft.PromptTuningConfig(num_virtual_tokens=32, task_type=task),
    }


def _build(transformers: Any, peft: Any, make: Callable[[], Any] | None, cache: bool) -> Any:
    """On the meta device, as ``fxmem analyze`` builds a spec; a method whose code reads weight values
    while it is built (BOFT) is built on the CPU instead, as fxmem's loader does (Note [A factory that
    needs real values] in fxmem/frontends/off_meta.py)."""
    from fxmem.frontends.off_meta import build_off_meta, counting_state, meta_failure

    config = transformers.AutoConfig.from_pretrained(str(CONFIG))
    config.use_cache = cache

    def factory() -> Any:
        model = transformers.LlamaForCausalLM(config)
        return model if make is None else peft.get_peft_model(model, make())

    torch.set_default_dtype(torch.bfloat16)
    try:
        with counting_state() as counted:
            try:
                with torch.device("meta"):
                    return factory()
            except Exception as e:
                if not meta_failure(e):
                    raise
                return build_off_meta(factory, "llama-3.2-3b", e, counted[0])
    finally:
        torch.set_default_dtype(torch.float32)


def _row(name: str, make: Callable[[], Any] | None, cache: bool) -> list[str]:
    import fxmem
    import peft
    import transformers

    from fxmem.output.render import format_bytes, format_count

    start = time.perf_counter()
    try:
        model = _build(transformers, peft, make, cache)
        inputs = {"input_ids": f"B,{TOKENS}:int64", "labels": f"B,{TOKENS}:int64"}
        report = fxmem.analyze(model, inputs, loss="auto", batch=BATCH, gpu=GPU, precision="bf16", name=name)
    except Exception as e:  # a method peft or fxmem cannot run here: its reason, in one line
        return [name, "-", "-", "-", "-", f"{time.perf_counter() - start:.1f}", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"]
    seconds = time.perf_counter() - start
    peak = report.peak(BATCH)
    total = report.step_bytes(BATCH)
    return [name, format_bytes(total), format_bytes(peak.bytes), format_count(report.state.trainable), "yes" if report.fits() else "no", f"{seconds:.1f}", ""]


def main(argv: list[str]) -> int:
    from tabulate import tabulate

    warnings.filterwarnings("ignore")
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    cache = "--no-cache" not in argv
    asked = [a for a in argv if not a.startswith("--")]
    methods = _methods(peft)
    unknown = [a for a in asked if a not in methods]
    if unknown:
        print(f"unknown method {unknown[0]!r}; choose from {', '.join(methods)}", file=sys.stderr)
        return 2
    rows = [_row(name, methods[name], cache) for name in asked or methods]
    print(f"Llama-3.2-3B, bf16 base, B={BATCH} x {TOKENS} tokens, AdamW, NVIDIA L40S (48 GB); use_cache={cache}")
    print(tabulate(rows, headers=["method", "GPU total", "tensor peak", "trainable", "fits", "seconds", "not analyzed"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
