"""Bytes and schemas: report models and their encodings, with no I/O policy and no concurrency."""

from wattflow.formats.errors import DecodeError, WattflowError
from wattflow.formats.reports import (
    REPORT_KINDS,
    EventReport,
    FormulaReport,
    GPUReport,
    HWPCReport,
    MeterReport,
    PowerReport,
    ProcfsReport,
    Report,
    report_kind,
)

__all__ = [
    "REPORT_KINDS",
    "DecodeError",
    "EventReport",
    "FormulaReport",
    "GPUReport",
    "HWPCReport",
    "MeterReport",
    "PowerReport",
    "ProcfsReport",
    "Report",
    "WattflowError",
    "report_kind",
]
