"""How close is the predicted peak of a training step to a real one? Zoo test configs on this CPU.

For each zoo model (its small test config), optimizer and batch, one real step runs under
torch.profiler (``fxmem.measure_peak``) beside fxmem's fake-tensor prediction; the script prints the
ratio predicted / measured and whether the phase of the peak agrees. The tests assert 1% on the same
cases (tests/test_peak_zoo.py); this prints the figures.

    python benchmarks/peak.py                 # adamw at B=1 and 4
    python benchmarks/peak.py sgd 8           # another optimizer and batch
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    import fxmem
    from models_zoo import ZOO

    optimizer = argv[0] if argv else "adamw"
    batches = [int(a) for a in argv[1:]] or [1, 4]
    print(f"{'model':<12}{'B':>3}{'step':>8}{'predicted':>14}{'measured':>14}{'ratio':>9}  phase (predicted / measured)")
    for name in ZOO:
        spec = fxmem.load_model(f"zoo:{name}:test")
        report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, optimizer=optimizer, name=name, target="cpu")
        for batch in batches:
            for first in (True, False):
                real = fxmem.load_model(f"zoo:{name}:test", meta=False).model
                measured = fxmem.measure_peak(real, spec.inputs, batch, loss=spec.loss, optimizer=optimizer, first_step=first)
                predicted = report.peak(batch, first_step=first)
                same = "same" if predicted.phase == measured.phase else "DIFFERENT"
                print(
                    f"{name:<12}{batch:>3}{'first' if first else 'steady':>8}{predicted.bytes:>14,}{measured.bytes:>14,}"
                    f"{predicted.bytes / measured.bytes:>9.4f}  {predicted.phase} / {measured.phase} ({same})"
                )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    start = time.perf_counter()
    code = main(sys.argv[1:])
    print(f"({time.perf_counter() - start:.0f} s)")
    raise SystemExit(code)
