"""Settings of the NVML input (``--input nvml``): its config model is its documentation, its
validation and its command-line flags."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, NonNegativeInt, PositiveInt, field_validator

from wattflow.actors.backend import split_commas
from wattflow.actors.pullers.base import PullerConfig
from wattflow.formats.reports import GPUReport

DeviceList = Annotated[list[NonNegativeInt], BeforeValidator(split_commas)]
"""GPU indexes, as a list or comma-separated (``--devices 0,2``)."""


class NvmlPullerConfig(PullerConfig):
    """Settings of the NVML sampler (``--input nvml``)."""

    type: Literal["nvml"] = "nvml"
    model: str = Field(
        default="GPUReport",
        description="Report kind the sampler writes: always GPUReport.",
        json_schema_extra={"flags": ["-m", "--model"]},
    )
    interval_ms: PositiveInt = Field(default=100, description="Sampling period in ms.")
    window_ms: PositiveInt = Field(
        default=1000,
        description="How often the per-process utilisation and the driver's power samples "
        "are read, in ms (each read costs milliseconds of CPU on recent drivers).",
    )
    energy_ms: PositiveInt = Field(
        default=2000,
        description="How often the energy counter is read, in ms (4 ms of CPU a read on an "
        "H100); the ticks in between report power readings, and the GPU formula shares the "
        "counter's increase among them. Keep it below the formula's --gpu-hold-ms.",
    )
    batch_ms: PositiveInt = Field(
        default=1000,
        description="How often sampled ticks go down the pipeline, in ms: every tick is still "
        "its own report, but a batch costs the pipeline about what one report does, so "
        "larger batches cost less CPU and smaller ones arrive sooner.",
    )
    devices: DeviceList | None = Field(
        default=None, description="GPU indexes to sample, comma-separated (default: all)."
    )
    cgroup_root: Path = Field(
        default=Path("/proc"),
        description="Where the processes' <pid>/cgroup and <pid>/stat files are (the host's "
        "/proc when the sampler runs in a container).",
    )
    sensor: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="Sensor name of the reports (default: the host name).",
        json_schema_extra={"default_doc": "the host name"},
    )

    @field_validator("model")
    @classmethod
    def _gpu_reports_only(cls, value: str) -> str:
        if value != GPUReport.kind:
            raise ValueError(f"the nvml input writes GPUReport, not {value!r}")
        return value
