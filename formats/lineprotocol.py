"""Reports as InfluxDB line protocol, with the points PowerAPI 2.10 writes.

PowerReport → measurement ``power_consumption``, tags ``sensor``, ``target`` and the report's
metadata (nested tables flattened one level as ``parent_child``; ``.``, ``-`` and ``/`` in tag
names replaced by ``_``, with a CRC32 suffix where two names would collide, as PowerAPI does),
field ``power``. ``--tags`` keeps only the named metadata tags. Every metadata value is a tag, as
in PowerAPI (so ``ratio`` is a tag there too).

FormulaReport → measurement ``formula_report``, tags ``sensor`` and ``target``, its metadata as
fields: numbers as float fields, booleans as booleans, text as strings, and nested values as
JSON text. (PowerAPI 2.10 defines this point but fails to write it.)

wattflow's own kinds: GPUReport → ``gpu``, one point per device (tag ``device``), each numeric
reading a field, absent readings left out; MeterReport → ``meter``, one point per channel (tag
``channel``, field ``power_mw``); EventReport → ``event``, field ``event`` (and ``data``).

Times are Unix milliseconds (write with ``precision=ms``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any
from zlib import crc32

import orjson

from wattflow.formats.reports import (
    EventReport,
    FormulaReport,
    GPUReport,
    MeterReport,
    PowerReport,
    Report,
    to_millis,
)

_TAG_NAME_TRANSLATION = str.maketrans({".": "_", "-": "_", "/": "_"})
_KEY_ESCAPES = str.maketrans({",": r"\,", "=": r"\=", " ": r"\ ", "\n": r"\n"})
_MEASUREMENT_ESCAPES = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\n"})
_GPU_FIELDS = (
    "power", "total_energy", "util_gpu", "util_mem", "clock_gpu", "clock_mem", "app_clock_gpu",
    "app_clock_mem", "enforced_power_limit", "power_state", "temperature", "pci_tx", "pci_rx",
)  # fmt: skip


def flatten_tags(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Nested tables one level deep become ``parent_child`` tags, as PowerAPI flattens them."""
    flat: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, Mapping):
            for child, inner in value.items():
                flat[f"{key}_{child}"] = inner
        else:
            flat[key] = value
    return flat


def sanitized_names(names: Iterable[str]) -> dict[str, str]:
    """Each tag name and the name InfluxDB and Prometheus accept, made unique as PowerAPI does."""
    sanitized = {name: name.translate(_TAG_NAME_TRANSLATION) for name in names}
    counts = Counter(sanitized.values())
    return {
        name: new if counts[new] == 1 else f"{new}_{crc32(name.encode()):x}"
        for name, new in sanitized.items()
    }


def power_tags(report: Report, selected: Iterable[str] = ()) -> dict[str, str]:
    """``sensor``, ``target`` and the metadata tags (only ``selected`` ones when given)."""
    flat = flatten_tags(report.metadata)
    names = sanitized_names(flat)
    wanted = set(selected)
    tags = {"sensor": report.sensor, "target": report.target}
    for name, value in flat.items():
        new = names[name]
        if not wanted or new in wanted:
            tags[new] = _tag_value(value)
    return tags


def _tag_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "True" if value else "False"  # as Python's str(), which PowerAPI's client uses
    if isinstance(value, list | dict):
        return orjson.dumps(value).decode()
    return str(value)


def _escape_key(text: str) -> str:
    return text.translate(_KEY_ESCAPES)


def _field_value(value: Any) -> str | None:
    """A field value in line protocol; None for what a field cannot hold (NaN, None)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        number = float(value)
        return None if math.isnan(number) or math.isinf(number) else repr(number)
    if value is None:
        return None
    text: str = value if isinstance(value, str) else orjson.dumps(value).decode()
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def point(
    measurement: str, tags: Mapping[str, str], fields: Mapping[str, Any], millis: int
) -> str | None:
    """One line, or None when no field has a value (InfluxDB refuses a point without fields)."""
    rendered = [
        f"{_escape_key(key)}={text}"
        for key, value in fields.items()
        if (text := _field_value(value)) is not None
    ]
    if not rendered:
        return None
    tag_text = "".join(
        f",{_escape_key(key)}={_escape_key(value)}"
        for key, value in sorted(tags.items())
        if value != ""
    )
    return f"{measurement.translate(_MEASUREMENT_ESCAPES)}{tag_text} {','.join(rendered)} {millis}"


def lines(report: Report, selected_tags: Iterable[str] = ()) -> list[str]:
    """The report's points (most kinds have one; GPU and meter reports one per device or channel).

    Raises:
        ValueError: for a report kind with no point layout.
    """
    millis = to_millis(report.timestamp)
    found: list[str | None]
    if type(report) is PowerReport:
        found = [
            point(
                "power_consumption",
                power_tags(report, selected_tags),
                {"power": report.power},
                millis,
            )
        ]
    elif isinstance(report, FormulaReport):
        tags = {"sensor": report.sensor, "target": report.target}
        found = [point("formula_report", tags, report.metadata, millis)]
    elif isinstance(report, GPUReport):
        found = []
        for index, device in report.devices.items():
            values = {name: getattr(device, name) for name in _GPU_FIELDS}
            tags = {"sensor": report.sensor, "target": report.target, "device": index}
            found.append(point("gpu", tags, values, millis))
    elif isinstance(report, MeterReport):
        found = [
            point(
                "meter",
                {"sensor": report.sensor, "target": report.target, "channel": channel},
                {"power_mw": value},
                millis,
            )
            for channel, value in report.channels.items()
        ]
    elif isinstance(report, EventReport):
        tags = {"sensor": report.sensor, "target": report.target}
        found = [point("event", tags, {"event": report.event, "data": report.data}, millis)]
    else:
        raise ValueError(f"no InfluxDB point layout for {report.kind}")
    return [line for line in found if line is not None]
