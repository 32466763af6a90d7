"""The errors of ``paco-compare``: experiments that cannot be compared, a missing metric."""
from __future__ import annotations


class CompareError(RuntimeError):
    """The experiments cannot be compared (none found, a bad ``dvc exp show`` document, an
    unknown ablation or experiment name, samples that do not pair up)."""


class MissingMetricError(CompareError, KeyError):
    """An experiment lacks a metric, a params key or a file the report needs; the message
    names the experiment and the metric."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
