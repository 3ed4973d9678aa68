"""Reports as InfluxDB line protocol, with the points PowerAPI 2.10 writes.

PowerReport → measurement ``power_consumption``, tags ``sensor``, ``target`` and the report's
metadata (nested tables flattened one level as ``parent_child``; ``.``, ``-`` and ``/`` in tag
names replaced by ``_``, with a CRC32 suffix where two names would collide, as PowerAPI does),
field ``power``. ``--tags`` keeps only the named (sanitised) metadata tags. Tag values are
Python's ``str()`` of the value, which is what PowerAPI's client writes; ``None`` and empty
values are left out, as there.

The metadata that change with every report or model, :data:`FIELD_KEYS` (``ratio``, the model
hash ``formula``, the node formula's ``cpu``, ``dram`` and ``gpu`` watts), are fields rather
than tags: InfluxDB keeps one series per distinct tag set, so a tag per float value grows the
index without end. ``--tags`` naming one of them makes it a tag again. With ``powerapi_layout``
every metadata key is a tag, as PowerAPI 2.10 writes it, and a PowerReport's line is byte for
byte the one ``influxdb-client`` makes of PowerAPI's point.

FormulaReport → measurement ``formula_report``, tags ``sensor`` and ``target``, its metadata as
fields. Numbers are written as floats, integers included: a model's ``error`` or ``intercept``
may be ``0`` in one report and ``0.5`` in the next, and InfluxDB refuses a field whose type
changes (``field type conflict``). Booleans stay booleans, text is a string field, and nested
values (coefficient lists, tables) are JSON-encoded into a string field rather than dropped, so
the model can be read back whole. (PowerAPI 2.10 defines this point but fails to write it.)

wattflow's own kinds: GPUReport → ``gpu``, one point per device (tag ``device``), each numeric
reading a field, absent readings left out; MeterReport → ``meter``, one point per channel (tag
``channel``, field ``power_mw``); EventReport → ``event``, field ``event`` (and ``data``);
TargetEnergyReport → ``target_energy``, tags ``sensor``, ``target``, ``reason`` and the
workload's names, fields ``cpu_j``, ``dram_j``, ``gpu_j``, ``start_ms`` and ``duration_s``.

Times are Unix milliseconds: write them with ``precision=ms``. Everything here is pure: no I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime
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
    TargetEnergyReport,
    to_millis,
)

_TAG_NAME_TRANSLATION = str.maketrans({".": "_", "-": "_", "/": "_"})
# The escapes influxdb-client applies, so that lines match the ones PowerAPI's client writes.
_KEY_ESCAPES = str.maketrans(
    {",": r"\,", "=": r"\=", " ": r"\ ", "\n": r"\n", "\t": r"\t", "\r": r"\r"}
)
_MEASUREMENT_ESCAPES = str.maketrans(
    {",": r"\,", " ": r"\ ", "\n": r"\n", "\t": r"\t", "\r": r"\r"}
)
_STRING_ESCAPES = str.maketrans({'"': r"\"", "\\": "\\\\"})
_GPU_FIELDS = (
    "power", "total_energy", "util_gpu", "util_mem", "clock_gpu", "clock_mem", "app_clock_gpu",
    "app_clock_mem", "enforced_power_limit", "power_state", "temperature", "pci_tx", "pci_rx",
)  # fmt: skip

PowerLayout = tuple[tuple[str, int], ...]
"""Tag prefixes (``,name=``) in line order, each with the index of its value in
``(sensor, target, *metadata.values())``."""

FieldLayout = tuple[tuple[str, int], ...]
"""Field names (escaped) in line order, each with the index of its value as in
:data:`PowerLayout`; ``power`` has index -1."""

FIELD_KEYS = frozenset(
    {"ratio", "formula", "cpu", "dram", "gpu", "active_power_w", "active_power_stderr_w"}
)
"""Metadata written as fields of a PowerReport's point unless ``--tags`` names them: values that
change with every report (a ratio, watts, a GPU process's learned power) or every model
(SmartWatts' hash)."""

_LAYOUTS_KEPT = 4096
"""Most PowerReport layouts one :class:`LineEncoder` keeps; it starts afresh past that."""


def flatten_tags(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Nested tables one level deep become ``parent_child`` tags, as PowerAPI flattens them.

    Like PowerAPI, only ``dict`` values are tables, and a flattened name that repeats an
    earlier key replaces it.
    """
    flat: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, dict):
            for child, inner in value.items():
                flat[f"{key}_{child}"] = inner
        else:
            flat[key] = value
    return flat


def sanitized_names(names: Iterable[str]) -> dict[str, str]:
    """Each tag name and the name InfluxDB and Prometheus accept, made unique as PowerAPI does.

    A suffix is added only where two names collide, so that a name stays the same from one
    report to the next as long as its neighbours do, as PowerAPI's names do.
    """
    sanitized = {name: name.translate(_TAG_NAME_TRANSLATION) for name in names}
    counts = Counter(sanitized.values())
    return {
        name: new if counts[new] == 1 else f"{new}_{crc32(name.encode()):x}"
        for name, new in sanitized.items()
    }


def power_tags(report: Report, selected: Iterable[str] = ()) -> dict[str, Any]:
    """``sensor``, ``target`` and the metadata tags (only ``selected`` ones when given), every
    metadata key a tag as PowerAPI 2.10 makes them.

    Values are left as they are (``str()`` is applied when the line is written); a metadata
    tag named ``sensor`` or ``target`` replaces the report's, as PowerAPI's ``|`` merge does.
    """
    flat = flatten_tags(report.metadata)
    names = sanitized_names(flat)
    wanted = set(selected)
    tags: dict[str, Any] = {"sensor": report.sensor, "target": report.target}
    for name, value in flat.items():
        new = names[name]
        if not wanted or new in wanted:
            tags[new] = value
    return tags


def _is_field(name: str, wanted: set[str], powerapi_layout: bool) -> bool:
    """Whether a (sanitised) metadata name is written as a field rather than a tag."""
    return not powerapi_layout and name in FIELD_KEYS and name not in wanted


def _tag_text(value: Any) -> str:
    """A tag value as influxdb-client writes it: ``str()`` of it, escaped.

    The client adds a space after a final backslash, which would otherwise escape the space
    that ends the tag set; the same is done here so that lines stay PowerAPI's.
    """
    text: str = (value if value.__class__ is str else str(value)).translate(_KEY_ESCAPES)
    return text + " " if text.endswith("\\") else text


def _float_text(number: float) -> str:
    """A float without a trailing ``.0``, as influxdb-client writes it (still a float field)."""
    text = repr(number)
    return text[:-2] if text.endswith(".0") else text


def _field_value(value: Any) -> str | None:
    """A field value in line protocol; None for what a field cannot hold (NaN, infinity, None)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        number = float(value)
        return None if math.isnan(number) or math.isinf(number) else _float_text(number)
    if value is None:
        return None
    text: str = value if isinstance(value, str) else orjson.dumps(value).decode()
    # Line protocol quotes strings: only '"' and '\' are escaped; a newline is kept as it is.
    return '"' + text.translate(_STRING_ESCAPES) + '"'


def point(
    measurement: str, tags: Mapping[str, Any], fields: Mapping[str, Any], millis: int
) -> str | None:
    """One line, or None when no field has a value (InfluxDB refuses a point without fields).

    Tags and fields are sorted by name, as influxdb-client sorts them; tags with no value
    (``None`` or empty text) are left out, as there.
    """
    rendered = [
        f"{key.translate(_KEY_ESCAPES)}={text}"
        for key, value in sorted(fields.items())
        if (text := _field_value(value)) is not None
    ]
    if not rendered:
        return None
    tag_text = "".join(
        f",{key.translate(_KEY_ESCAPES)}={text}"
        for key, value in sorted(tags.items())
        if value is not None and (text := _tag_text(value)) != "" and key != ""
    )
    return f"{measurement.translate(_MEASUREMENT_ESCAPES)}{tag_text} {','.join(rendered)} {millis}"


def _power_layout(
    keys: tuple[str, ...], selected: tuple[str, ...], powerapi_layout: bool
) -> tuple[PowerLayout, FieldLayout]:
    """Where each tag and field of a PowerReport with these flat metadata keys goes in its
    line (tags and fields each sorted by name, as influxdb-client sorts them)."""
    names = sanitized_names(keys)
    wanted = set(selected)
    index_of = {"sensor": 0, "target": 1}
    field_of = {"power": -1}
    for position, key in enumerate(keys):
        name = names[key]
        if _is_field(name, wanted, powerapi_layout):
            field_of[name] = position + 2
        elif not wanted or name in wanted:
            index_of[name] = position + 2
    tags = tuple(
        (f",{name.translate(_KEY_ESCAPES)}=", index)
        for name, index in sorted(index_of.items())
        if name != ""
    )
    fields = tuple(
        (name.translate(_KEY_ESCAPES), index) for name, index in sorted(field_of.items())
    )
    return tags, fields


def _general_power_line(
    report: PowerReport, selected: Iterable[str], powerapi_layout: bool = False
) -> str:
    """A PowerReport's line the long way (nested metadata, or a subclass)."""
    tags = power_tags(report, selected)
    fields: dict[str, Any] = {"power": report.power}
    if not powerapi_layout:
        wanted = set(selected)
        flat = flatten_tags(report.metadata)
        names = sanitized_names(flat)
        for key, value in flat.items():
            name = names[key]
            if _is_field(name, wanted, powerapi_layout):
                tags.pop(name, None)
                fields[name] = value
    if not math.isfinite(report.power):
        raise ValueError(f"power is {report.power}: InfluxDB cannot store it")
    line = point("power_consumption", tags, fields, to_millis(report.timestamp))
    assert line is not None  # power is a finite number: the point has a field
    return line


class LineEncoder:
    """Writes reports as lines for one output, with the ``--tags`` it selects.

    Formulas write thousands of PowerReports a second, nearly all with the same metadata keys:
    the sanitised, selected and sorted tag names are worked out once per set of keys, kept here
    (by whoever holds the encoder: a batch, an output), and only the values are written per
    report. Metadata with a nested table takes the general path.
    """

    __slots__ = ("_last_time", "_layouts", "powerapi_layout", "selected")

    def __init__(self, selected_tags: Iterable[str] = (), powerapi_layout: bool = False) -> None:
        self.selected = tuple(selected_tags)
        self.powerapi_layout = powerapi_layout
        self._layouts: dict[tuple[str, ...], tuple[PowerLayout, FieldLayout]] = {}
        # One tick's reports share their timestamp object: its milliseconds, worked out once.
        # A tuple is replaced whole, so threads encoding at once never read one time with
        # another's milliseconds.
        self._last_time: tuple[datetime | None, int] = (None, 0)

    def lines(self, report: Report) -> list[str]:
        """The report's points (most kinds have one; GPU and meter reports one per device or
        channel).

        Raises:
            ValueError: for a report kind with no point layout, or a PowerReport or
                FormulaReport with nothing InfluxDB can store (a NaN power, no usable metadata).
        """
        if type(report) is PowerReport:
            return [self._power_line(report)]
        return _other_lines(report, self.selected, self.powerapi_layout)

    def _power_line(self, report: PowerReport) -> str:
        """A PowerReport's line, without building its tag table."""
        metadata = report.metadata
        values = (report.sensor, report.target, *metadata.values())
        for value in values:
            if value.__class__ is dict:
                return _general_power_line(report, self.selected, self.powerapi_layout)
        keys = tuple(metadata)
        found = self._layouts.get(keys)
        if found is None:
            if len(self._layouts) >= _LAYOUTS_KEPT:
                self._layouts.clear()
            found = self._layouts[keys] = _power_layout(keys, self.selected, self.powerapi_layout)
        layout, fields = found
        power = report.power
        if not math.isfinite(power):
            raise ValueError(f"power is {power}: InfluxDB cannot store it")
        parts = ["power_consumption"]
        for prefix, index in layout:
            value = values[index]
            if value is not None:
                text = _tag_text(value)
                if text:
                    parts.append(prefix)
                    parts.append(text)
        timestamp = report.timestamp
        last = self._last_time
        if last[0] is timestamp:
            millis = last[1]
        else:
            millis = to_millis(timestamp)
            self._last_time = (timestamp, millis)
        if len(fields) == 1:  # power alone
            parts.append(f" power={_float_text(float(power))} {millis}")
        else:
            parts.append(f" {_fields_text(fields, values, power)} {millis}")
        return "".join(parts)


def _fields_text(fields: FieldLayout, values: tuple[Any, ...], power: float) -> str:
    """``power`` and the metadata written as fields, those without a value left out."""
    rendered = []
    for name, index in fields:
        if index < 0:
            text: str | None = _float_text(float(power))
        else:
            value = values[index]
            if value.__class__ is float and math.isfinite(value):  # a ratio: the usual case
                text = _float_text(value)
            elif value.__class__ is str:  # a model hash
                text = '"' + value.translate(_STRING_ESCAPES) + '"'
            else:
                text = _field_value(value)
        if text is not None:
            rendered.append(f"{name}={text}")
    return ",".join(rendered)


def lines(
    report: Report, selected_tags: Iterable[str] = (), powerapi_layout: bool = False
) -> list[str]:
    """The report's points (most kinds have one; GPU and meter reports one per device or channel).

    ``selected_tags`` applies to PowerReports only, as PowerAPI's ``--tags`` does;
    ``powerapi_layout`` makes every metadata key a tag, as PowerAPI 2.10 does. Writing many
    reports, a :class:`LineEncoder` (or :func:`requests`) works each PowerReport layout out once.

    Raises:
        ValueError: for a report kind with no point layout, or a PowerReport or FormulaReport
            with nothing InfluxDB can store (a NaN power, no usable metadata).
    """
    return LineEncoder(selected_tags, powerapi_layout).lines(report)


def _other_lines(
    report: Report, selected_tags: Iterable[str], powerapi_layout: bool = False
) -> list[str]:
    """The points of a report that is not exactly a PowerReport."""
    millis = to_millis(report.timestamp)
    found: list[str | None]
    if isinstance(report, PowerReport):  # a subclass: no fast path
        return [_general_power_line(report, selected_tags, powerapi_layout)]
    if isinstance(report, FormulaReport):
        return [_formula_line(report, millis)]
    if isinstance(report, GPUReport):
        found = _gpu_lines(report, millis)
    elif isinstance(report, MeterReport):
        found = _meter_lines(report, millis)
    elif isinstance(report, EventReport):
        tags = {"sensor": report.sensor, "target": report.target}
        found = [point("event", tags, {"event": report.event, "data": report.data}, millis)]
    elif isinstance(report, TargetEnergyReport):
        found = [_target_energy_line(report, millis)]
    else:
        raise ValueError(f"no InfluxDB point layout for {report.kind}")
    return [line for line in found if line is not None]


def _formula_line(report: FormulaReport, millis: int) -> str:
    """A FormulaReport's point: its metadata (the model) as fields.

    Raises:
        ValueError: when no metadata value is one InfluxDB can store.
    """
    tags = {"sensor": report.sensor, "target": report.target}
    line = point("formula_report", tags, report.metadata, millis)
    if line is None:
        raise ValueError("no metadata value InfluxDB can store as a field")
    return line


def _gpu_lines(report: GPUReport, millis: int) -> list[str | None]:
    """One point per GPU, tagged with its index; ``None`` for a GPU with no field to store."""
    found: list[str | None] = []
    for index, device in report.devices.items():
        values = {name: getattr(device, name) for name in _GPU_FIELDS}
        tags = {"sensor": report.sensor, "target": report.target, "device": index}
        found.append(point("gpu", tags, values, millis))
    return found


def _meter_lines(report: MeterReport, millis: int) -> list[str | None]:
    """One point per meter channel, tagged with its name."""
    return [
        point(
            "meter",
            {"sensor": report.sensor, "target": report.target, "channel": channel},
            {"power_mw": value},
            millis,
        )
        for channel, value in report.channels.items()
    ]


def _target_energy_line(report: TargetEnergyReport, millis: int) -> str | None:
    """A workload's record: its names as tags (one value each for the workload's life), its
    energy per scope, in J, and its span as fields."""
    tags = {
        "sensor": report.sensor,
        "target": report.target,
        "reason": report.reason,
        **flatten_tags(report.metadata),
    }
    fields: dict[str, Any] = {f"{scope}_j": float(j) for scope, j in report.energy.items()}
    fields["start_ms"] = to_millis(report.start)
    fields["duration_s"] = (report.end - report.start).total_seconds()
    return point("target_energy", tags, fields, millis)


Request = tuple[list[Report], list[str]]
"""The reports one write request carries, and their lines."""


def requests(
    reports: Iterable[Report],
    selected_tags: Iterable[str],
    max_points: int,
    powerapi_layout: bool = False,
) -> tuple[list[Request], list[tuple[Report, str]]]:
    """A batch's lines cut into requests of at most ``max_points`` lines, and the refused reports.

    A report's lines stay in one request, so that a request the server refuses names exactly
    the reports it held; a report with more lines than ``max_points`` (a GPU report of a large
    node under a tiny limit) goes alone.
    """
    encoder = LineEncoder(selected_tags, powerapi_layout)
    found: list[Request] = []
    refused: list[tuple[Report, str]] = []
    held: list[Report] = []
    held_lines: list[str] = []
    for report in reports:
        try:
            report_lines = encoder.lines(report)
        except ValueError as error:
            refused.append((report, str(error)))
            continue
        if held and len(held_lines) + len(report_lines) > max_points:
            found.append((held, held_lines))
            held, held_lines = [], []
        held.append(report)
        held_lines.extend(report_lines)
    if held_lines:
        found.append((held, held_lines))
    return found, refused
