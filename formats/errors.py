"""Errors raised while decoding and encoding reports."""

from __future__ import annotations


class WattflowError(Exception):
    """Base of every error wattflow raises on purpose."""


class DecodeError(WattflowError, ValueError):
    """Input that cannot become a report.

    The message names where the input came from (file or peer), the line, and what is wrong
    (usually the missing or invalid field), so that a user can find and fix it.
    """

    def __init__(self, source: str, line: int | None, problem: str) -> None:
        self.source = source
        self.line = line
        self.problem = problem
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {problem}")


def describe_validation_error(error: Exception) -> str:
    """Say in one line which field is missing or invalid, from a pydantic ValidationError."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return str(error)
    parts = []
    for item in error.errors()[:3]:
        location = ".".join(str(p) for p in item["loc"]) or "report"
        if item["type"] == "missing":
            parts.append(f"missing field '{location}'")
        else:
            parts.append(f"field '{location}': {item['msg']}")
    more = error.error_count() - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)
