"""The precisions a run can train in and what a user may ask for, by name.

Kept apart from `monai_fast.telemetry.precision` (which needs torch) so that a command line
lists them as choices without loading torch.

Examples:
    >>> from monai_fast.precision_names import REQUESTS
    >>> REQUESTS
    ('auto', 'bf16', 'fp16', 'fp32')
"""

from __future__ import annotations

__all__ = ["PRECISIONS", "REQUESTS"]

#: precisions a run can train in (``"fp32"``: autocast off)
PRECISIONS = ("bf16", "fp16", "fp32")
#: what a user may ask for: a precision, or ``"auto"`` to let ``choose_precision`` decide
REQUESTS = ("auto", *PRECISIONS)
