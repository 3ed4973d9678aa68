"""Pydantic models of every report kind that moves through wattflow.

Reports are the only thing that moves between actors. Each kind shares PowerAPI's common base
(``timestamp``, ``sensor``, ``target``, ``metadata``) and adds one payload. The models validate
at the edges (decoding); inside the pipeline reports are trusted and never re-validated, which is
why formulas build their outputs with :meth:`Report.trusted`.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal, Self, cast

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_utc(value: Any) -> datetime:
    """Turn any timestamp form PowerAPI writes into a timezone-aware UTC datetime.

    Integers and floats are Unix milliseconds (PowerAPI's CSV layout); strings are ISO 8601,
    naive ones taken as UTC (hwpc-sensor writes naive UTC); BSON dates arrive as naive UTC
    datetimes from pymongo.

    Raises:
        ValueError: when the value is none of these forms.
    """
    if isinstance(value, datetime):
        return _utc(value)
    if isinstance(value, bool):
        raise ValueError("a timestamp cannot be a boolean")
    if isinstance(value, int | float):
        return _from_millis(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            return _from_millis(int(text))
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(
                f"timestamp {value!r} is neither Unix milliseconds nor ISO 8601"
            ) from None
        return _utc(parsed)
    raise ValueError(f"timestamp {value!r} is neither Unix milliseconds nor ISO 8601")


def _utc(moment: datetime) -> datetime:
    """A datetime in UTC, naive ones taken as UTC; one whose zone moves it past the first or
    the last day Python holds (``0001-01-01T00:00:00+01:00``) is refused with a ValueError,
    as any other timestamp that cannot be read (pydantic turns only those into errors)."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"timestamp {moment.isoformat()} is out of range in UTC") from None


def _from_millis(millis: float) -> datetime:
    try:
        return _EPOCH + timedelta(milliseconds=millis)
    except OverflowError:
        raise ValueError(f"timestamp {millis!r} ms is out of range") from None


def to_millis(timestamp: datetime) -> int:
    """Unix milliseconds of a UTC datetime, as PowerAPI's CSV layout writes them."""
    delta = timestamp - _EPOCH
    return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000


def to_micros(timestamp: datetime) -> int:
    """Unix microseconds of a UTC datetime, exactly: a datetime's own resolution."""
    delta = timestamp - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(micros: int) -> datetime:
    """The UTC datetime of :func:`to_micros`."""
    return _EPOCH + timedelta(microseconds=micros)


Timestamp = Annotated[datetime, BeforeValidator(to_utc)]
"""A timestamp held as a timezone-aware UTC datetime, whatever form it arrived in."""

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
"""An integer every output can write: MongoDB holds signed 64-bit integers, and the JSON writers
no larger ones than 64 bits. A report with one beyond is refused at the input (a dead letter),
rather than made and then refused by an output with the whole batch it came in."""

Counter = Int64 | float
"""A hardware counter value: hwpc-sensor writes integers, its MongoDB backend doubles. An
integer beyond a signed 64-bit one (no real counter reaches 2⁶³) is read as the double it is
nearest, as readers of JSON that hold numbers as doubles read it."""

METADATA_DEPTH = 32
"""How deep metadata may nest: far beyond what any sensor or formula writes, and well inside
what every output holds (MongoDB's documents nest up to 100 levels)."""

_JSON_SCALARS = (str, float, bool, type(None), datetime)


ReportMetadata = dict[str, Any]
"""A report's metadata: free key-value pairs of JSON's kinds of data and dates, as
:func:`check_metadata` allows them (an input's own, carried on as it came)."""


def check_metadata(metadata: ReportMetadata) -> ReportMetadata:
    """Refuse metadata that some output could not write, naming the first such value: anything
    but JSON's kinds of data and dates (a MongoDB document's ObjectId, Decimal128 or binary),
    an integer beyond 64 bits, a key with a NUL character (BSON's keys end at one), or nesting
    deeper than :data:`METADATA_DEPTH`.

    Raises:
        ValueError: naming the key of the value and what is wrong with it.
    """
    pending: list[tuple[str, Any, int]] = [("metadata", metadata, 0)]
    while pending:
        where, value, depth = pending.pop()
        if isinstance(value, _JSON_SCALARS):
            continue
        if isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"{where}: the integer {value} is beyond 64 bits")
        elif depth >= METADATA_DEPTH:
            raise ValueError(f"{where}: nested deeper than {METADATA_DEPTH} levels")
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str) or "\0" in key:
                    raise ValueError(f"{where}: the key {key!r} is not a name MongoDB holds")
                pending.append((f"{where}.{key}", item, depth + 1))
        elif isinstance(value, list):
            pending.extend((f"{where}[{at}]", item, depth + 1) for at, item in enumerate(value))
        else:
            raise ValueError(f"{where}: {type(value).__name__} is not JSON data")
    return metadata


class Report(BaseModel):
    """PowerAPI's common base of every report.

    Unknown keys are ignored, as PowerAPI ignores them: MongoDB documents carry ``_id``, and
    newer sensors may add fields.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: ClassVar[str] = "Report"

    timestamp: Timestamp = Field(description="Time the measurement refers to, in UTC.")
    sensor: str = Field(min_length=1, description="Name that groups reports for one formula.")
    target: str = Field(min_length=1, description="Subject of the measurement.")
    metadata: Annotated[ReportMetadata, AfterValidator(check_metadata)] = Field(
        default_factory=dict, description="Free key-value pairs carried along."
    )

    @classmethod
    def trusted(cls, **fields: Any) -> Self:
        """Build a report from values the pipeline produced itself, skipping validation
        (pydantic's ``model_construct``; a field left out takes its default).

        Formulas and decoders create thousands of reports per second from inputs already
        checked; running the validators again would only cost time.
        """
        return cast(Self, cls.model_construct(**fields))


SOCKET_LIMIT = 65_536
"""Socket numbers a report may carry are below this (2¹⁶)."""

CPU_LIMIT = 1_048_576
"""Cpu numbers a report may carry are below this (2²⁰). Linux numbers cpus below its
``NR_CPUS``, whose largest setting (x86-64's and arm64's ``MAXSMP``) is 8,192: this leaves a
hundred times that, and keeps a cpu number, a socket number and a frame's tick and name counts
multiplied together far inside 64 bits."""

_PLAIN_SOCKETS = frozenset(map(str, range(1024)))
_PLAIN_CPUS = frozenset(map(str, range(8192)))
"""The keys nearly every report carries: a report whose keys are all among them is checked
with a few set operations in C."""


def number_below(text: str, limit: int) -> bool:
    """Whether a socket or cpu key is a number below ``limit``: ASCII digits only (a leading
    zero allowed, as the key's number is what counts), no sign, space or point."""
    digits = text.lstrip("0")
    return text.isascii() and text.isdigit() and len(digits) <= 7 and int(digits or "0") < limit


def bad_number_key(groups: dict[str, dict[str, dict[str, Any]]]) -> str | None:
    """Why a report's socket or cpu key cannot be taken, naming the first such key; ``None``
    when every socket is a number below :data:`SOCKET_LIMIT` and every cpu one below
    :data:`CPU_LIMIT`.

    The formulas use these numbers as array indexes and in keys made of several of them: a
    socket numbered 10¹⁸ would have SmartWatts allocate an array that long, or wrap a 64-bit
    key around. Every input refuses such a report at its edge (a dead letter with this reason),
    whatever the way it decodes it."""
    for group, sockets in groups.items():
        if _PLAIN_SOCKETS.issuperset(sockets) and all(
            _PLAIN_CPUS.issuperset(cpus) for cpus in sockets.values()
        ):
            continue
        for socket, cpus in sockets.items():
            if not number_below(socket, SOCKET_LIMIT):
                return (
                    f"socket {socket!r} of group {group!r} is not a socket number "
                    f"(0 to {SOCKET_LIMIT - 1})"
                )
            for cpu in cpus:
                if not number_below(cpu, CPU_LIMIT):
                    return (
                        f"cpu {cpu!r} of socket {socket!r} of group {group!r} is not a cpu "
                        f"number (0 to {CPU_LIMIT - 1})"
                    )
    return None


class HWPCReport(Report):
    """Performance counters and RAPL readings from hwpc-sensor.

    ``groups`` maps group → socket → cpu → event → value. RAPL values are per-interval energy
    deltas in units of 2^-32 J. Socket and cpu keys are strings, as in hwpc-sensor's JSON, each
    the decimal number of a socket below :data:`SOCKET_LIMIT` or a cpu below :data:`CPU_LIMIT`
    (:func:`bad_number_key`).
    """

    kind: ClassVar[str] = "HWPCReport"
    groups: dict[str, dict[str, dict[str, dict[str, Counter]]]] = Field(default_factory=dict)

    @field_validator("groups")
    @classmethod
    def _numbered(
        cls, groups: dict[str, dict[str, dict[str, dict[str, Counter]]]]
    ) -> dict[str, dict[str, dict[str, dict[str, Counter]]]]:
        problem = bad_number_key(groups)
        if problem is not None:
            raise ValueError(problem)
        return groups


class PowerReport(Report):
    """A power estimate for one target, in W."""

    kind: ClassVar[str] = "PowerReport"
    power: float = Field(
        description="Power in W: a finite number, as every output can write (JSON has no NaN, "
        "InfluxDB and Prometheus take no infinity).",
        allow_inf_nan=False,
    )


class FormulaReport(Report):
    """State of a formula's model (SmartWatts): everything it says is in ``metadata``."""

    kind: ClassVar[str] = "FormulaReport"


class ProcfsReport(Report):
    """CPU usage per cgroup from procfs-sensor, accepted for compatibility with PowerAPI."""

    kind: ClassVar[str] = "ProcfsReport"
    usage: dict[str, float] = Field(default_factory=dict)
    global_cpu_usage: float = 0.0


class GPUProcess(BaseModel):
    """One process's utilisation of a GPU over the last sampling interval."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: Int64
    sm_util: float = Field(ge=0, le=100, description="Share of SM time used, in %.")
    mem_util: float | None = Field(default=None, ge=0, le=100, description="In %.")
    cgroup: str | None = Field(default=None, description="cgroup the process belongs to.")
    started: Int64 | None = Field(
        default=None,
        description="When the process started, in clock ticks since boot (/proc/<pid>/stat): "
        "tells a process from an earlier one that had its pid.",
    )


class GPUInstanceActivity(BaseModel):
    """One MIG GPU instance's activity over a window, from the GPU's GPM counters (Hopper and
    newer), and the processes on it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Int64 = Field(description="The GPU instance id (nvidia-smi's GI ID).")
    graphics_util: float = Field(
        ge=0, le=100, description="Share of the window any engine of the instance was busy, in %."
    )
    sm_util: float | None = Field(
        default=None, ge=0, le=100, description="Share of the instance's SMs busy, in %."
    )
    pids: list[Int64] = Field(
        default_factory=list, description="Processes with a context on the instance."
    )
    cgroups: list[str | None] = Field(
        default_factory=list, description="The cgroup of each of `pids`, in their order."
    )


GPUSampleKind = Literal["TOTAL_POWER", "GPU_UTILIZATION", "MEMORY_UTILIZATION"]


class GPUDevice(BaseModel):
    """One GPU's readings in one sampling tick. A field the hardware does not support is absent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    power: float | None = Field(default=None, description="Power draw in mW.")
    power_averaged: bool | None = Field(
        default=None, description="Whether the driver averages `power` over a window."
    )
    total_energy: float | None = Field(default=None, description="Energy counter in mJ.")
    total_energy_us: Int64 | None = Field(
        default=None,
        description="When the driver read `total_energy` (Unix µs, its field value's own time): "
        "a tick stamped before a stall can read its counter well after its timestamp.",
    )
    util_gpu: float | None = Field(default=None, description="In %.")
    util_mem: float | None = Field(default=None, description="In %.")
    clock_gpu: float | None = Field(default=None, description="In MHz.")
    clock_mem: float | None = Field(default=None, description="In MHz.")
    app_clock_gpu: float | None = Field(default=None, description="In MHz.")
    app_clock_mem: float | None = Field(default=None, description="In MHz.")
    enforced_power_limit: float | None = Field(default=None, description="In mW.")
    power_state: Int64 | None = None
    temperature: float | None = Field(default=None, description="In °C.")
    pci_tx: float | None = Field(default=None, description="In KB/s.")
    pci_rx: float | None = Field(default=None, description="In KB/s.")
    samples: dict[GPUSampleKind, list[tuple[Int64, float]]] | None = Field(
        default=None, description="Driver sample buffers: [t_us, value] pairs."
    )
    processes: list[GPUProcess] | None = Field(
        default=None,
        description="Per-process utilisation; absent where the device cannot tell (MIG).",
    )
    process_window: tuple[Int64, Int64] | None = Field(
        default=None,
        description="[start_us, end_us]: the driver samples `processes` averages, those after "
        "start up to end; start = end when the driver had nothing new. Absent in recordings "
        "that predate it, whose processes cover their own tick.",
    )
    running_pids: list[Int64] | None = Field(
        default=None,
        description="Processes holding a compute context on the GPU when `processes` was read "
        "(NVML's running processes): a process absent from it has ended. Absent where not read.",
    )
    instances: list[GPUInstanceActivity] | None = Field(
        default=None,
        description="Under MIG with GPM: each GPU instance's activity over `instance_window`; "
        "absent where the GPU cannot tell (no MIG, or no GPM before Hopper).",
    )
    instance_window: tuple[Int64, Int64] | None = Field(
        default=None,
        description="[start_us, end_us]: the two GPM samples `instances` lies between; start = "
        "end between samples.",
    )


_DEVICE_FIELDS = set(GPUDevice.__pydantic_fields__)
EMPTY_DEVICE: dict[str, Any] = dict.fromkeys(_DEVICE_FIELDS)
"""Every field of a :class:`GPUDevice`, unset: the dict :func:`trusted_device` starts from."""


def trusted_device(fields: dict[str, Any]) -> GPUDevice:
    """A :class:`GPUDevice` from values its producer already checked, without validation
    (pydantic's ``model_construct``, every field counted as set so that it is written out).

    The NVML input builds one per GPU ten times a second; ``fields`` must hold every field (a
    copy of :data:`EMPTY_DEVICE`, filled in).
    """
    return GPUDevice.model_construct(_fields_set=_DEVICE_FIELDS, **fields)


class GPUReport(Report):
    """One sampling tick of the NVML sensor, for every GPU of the node (target ``all``)."""

    kind: ClassVar[str] = "GPUReport"
    devices: dict[str, GPUDevice] = Field(default_factory=dict)


class MeterReport(Report):
    """External power-meter readings: channel ``d{device}c{channel}`` → mW."""

    kind: ClassVar[str] = "MeterReport"
    channels: dict[str, float] = Field(default_factory=dict, description="Power per channel in mW.")


EventName = Literal[
    "experiment_begin",
    "train_begin",
    "epoch_begin",
    "batch_begin",
    "batch_end",
    "epoch_end",
    "train_end",
    "experiment_end",
]


def _event_data(value: Any) -> Any:
    """An event's data as given: whole numbers become the integer index the GPU directory's
    ``timestamps.csv`` holds; booleans are refused rather than read as 0 and 1."""
    if isinstance(value, bool):
        raise ValueError("an event's data is an index (an integer) or text, not a boolean")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


EventData = Annotated[Int64 | str | None, BeforeValidator(_event_data)]
"""An event's data: the index of the event (an epoch or batch number) as the GPU measurement
directory's spec has it, or text, as earlier recordings wrote it; ``None`` when unused."""


class EventReport(Report):
    """A run marker recorded by the program under measurement."""

    kind: ClassVar[str] = "EventReport"
    event: EventName
    data: EventData = Field(
        default=None,
        description="Index of the event (an epoch or batch number), or text; None when unused.",
    )


EnergyScope = Literal["cpu", "dram", "gpu"]
EndReason = Literal["silent", "gone", "evicted", "running"]


def _finite_joules(energy: dict[str, float]) -> dict[str, float]:
    for scope, joules in energy.items():
        if not math.isfinite(joules) or joules < 0:
            raise ValueError(f"energy of {scope}: {joules!r} is not a finite, non-negative J")
    return energy


class TargetEnergyReport(Report):
    """A workload's energy once it has ended (wattflow's own, from the ``energy`` formula):
    a Slurm job, a pod's container, a VM, a container or a service, named by ``target`` as
    the naming step names it (``slurm/1234``), with its names in ``metadata``."""

    kind: ClassVar[str] = "TargetEnergyReport"
    start: Timestamp = Field(description="Start of the first interval it drew power in.")
    end: Timestamp = Field(description="End of the last interval it drew power in.")
    energy: Annotated[dict[EnergyScope, float], AfterValidator(_finite_joules)] = Field(
        description="Energy per scope (cpu, dram, gpu), in J."
    )
    reason: EndReason = Field(
        description="Why it was reported: silent (no report for the configured time), gone "
        "(its cgroups no longer exist), evicted (more workloads than the formula keeps), "
        "running (the service stopped first: its energy so far)."
    )


REPORT_KINDS: dict[str, type[Report]] = {
    cls.kind: cls
    for cls in (
        HWPCReport,
        PowerReport,
        FormulaReport,
        ProcfsReport,
        GPUReport,
        MeterReport,
        EventReport,
        TargetEnergyReport,
    )
}
"""Every report kind by the name PowerAPI's ``--model`` flag uses."""


def report_kind(name: str) -> type[Report]:
    """The report class PowerAPI's ``--model`` names.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    try:
        return REPORT_KINDS[name]
    except KeyError:
        known = ", ".join(sorted(REPORT_KINDS))
        raise ValueError(f"unknown report model {name!r}; known: {known}") from None
