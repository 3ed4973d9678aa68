"""JSON Lines: one report per line in PowerAPI's JSON layout.

Recordings made for PowerAPI's file input hold a single JSON document instead, an object whose
``reports`` key lists the reports (PowerAPI's test recordings look like this); they are read too,
and replayed in timestamp order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from wattflow.formats.errors import DecodeError
from wattflow.formats.powerapi import CSV_ERRORS, NOT_UTF8, decode_document, not_utf8
from wattflow.formats.reports import Report


def is_reports_document(path: Path) -> bool:
    """Whether a file is a single ``{"reports": [...]}`` document rather than JSON Lines.

    Only the start is looked at, and bytes that are not UTF-8 there (a bad line, or a character
    cut at the end of the start) are no reason to refuse the file: they are its lines' business.
    """
    with path.open(encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096).lstrip()
    if not head.startswith("{"):
        return False
    return head[1:].lstrip().startswith('"reports"')


def read_reports_document(kind: type[Report], path: Path) -> Iterator[Report | DecodeError]:
    """Read a ``{"reports": [...]}`` document, yielding its reports in timestamp order.

    Raises:
        DecodeError: when the file is not such a document.
    """
    # Bytes that are not UTF-8 are kept as lone surrogates: the entry that holds them is a dead
    # letter, as a JSON line holding them is; anywhere else, the document is not JSON.
    text = path.read_text(encoding="utf-8", errors=CSV_ERRORS)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise DecodeError(str(path), error.lineno, f"not valid JSON: {error.msg}") from None
    except (ValueError, RecursionError) as error:  # an integer of 4,300 digits, deep nesting
        raise DecodeError(str(path), None, f"not valid JSON: {error}") from None
    entries = document.get("reports") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise DecodeError(str(path), 1, "missing field 'reports' (a list of reports)")
    decoded: list[Report] = []
    for position, entry in enumerate(entries):
        where = f"{path} reports[{position}]"
        try:
            if not_utf8(json.dumps(entry, ensure_ascii=False)):
                raise DecodeError(where, None, NOT_UTF8)
            decoded.append(decode_document(kind, entry, where, None))
        except DecodeError as error:
            yield error
    decoded.sort(key=lambda report: report.timestamp)
    yield from decoded
