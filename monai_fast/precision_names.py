"""The precisions a run can train in and what a user may ask for, by name.

Apart from `monai_fast.telemetry.precision` (which needs torch): a command line lists them without loading torch.
"""

from __future__ import annotations

__all__ = ["PRECISIONS", "REQUESTS"]

#: precisions a run can train in (``"fp32"``: autocast off)
PRECISIONS = ("bf16", "fp16", "fp32")
#: what a user may ask for: a precision, or ``"auto"`` to let ``choose_precision`` decide
REQUESTS = ("auto", *PRECISIONS)
