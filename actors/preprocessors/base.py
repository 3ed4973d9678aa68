"""What every pre-processor is: a config model, a check, and a pass over an input's batches.

PowerAPI binds a pre-processor to one input (its ``puller``) and runs it on every report that
input decodes, before the dispatcher; wattflow does the same in the input's emitter
(:mod:`wattflow.actors.pipeline`), after the partition's filter and before the router, so the
formulas only ever see targets as the pre-processor left them. A pre-processor may let a report
go (PowerAPI 2.10's k8s layout drops a pod's container it does not know): it says how many and
why, and the pipeline counts them in the ledger and ``/metrics``, never silently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wattflow.formats.batch import Batch


class PreProcessorConfig(BaseModel):
    """``type``, ``name`` and ``puller``, as PowerAPI's ``--pre-processor`` group names them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str = Field(description="Pre-processor type, e.g. `k8s`.")
    name: str = Field(
        default="",
        description="Name in logs and statistics (default: pre_processor_<type>).",
        json_schema_extra={"flags": ["-n", "--name"]},
    )
    puller: str = Field(
        description="Name of the input whose reports this pre-processor takes (one "
        "pre-processor per input, as in PowerAPI).",
        json_schema_extra={"flags": ["-p", "--puller"]},
    )

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("name"):
            kind = values.get("type") or cls.model_fields["type"].default
            return {**values, "name": f"pre_processor_{kind}"}
        return values


C = TypeVar("C", bound=PreProcessorConfig)


class PreProcessor(ABC, Generic[C]):
    """One input's pre-processor."""

    config_model: ClassVar[type[PreProcessorConfig]]

    def __init__(self, config: C, *, compat: bool = False) -> None:
        """``compat``: the service runs in SmartWatts 2.4.1's compat mode (whose PowerAPI is
        2.10), for pre-processors whose layout follows it."""
        self.config = config
        self.dropped: Counter[str] = Counter()
        """Reports let go, by reason."""

    async def check(self) -> None:
        """Fail (a :class:`~wattflow.formats.errors.WattflowError`, exit 2) when it cannot
        work here, before the pipeline starts."""

    async def probe(self) -> str:
        """Contact what it reads from, for ``wattflow check``: one line of what it found.

        Raises:
            WattflowError: it cannot work here.
        """
        return "nothing to contact"

    async def start(self) -> None:
        """Start what it reads from (the k8s pre-processor's watch of the pods)."""

    def stop(self) -> None:
        """Stop it; called once the inputs are done."""

    @abstractmethod
    def process(self, batch: Batch) -> tuple[Batch, Counter[str]]:
        """The batch as the formulas should see it, and the reports let go by reason."""

    names_outputs: bool = False
    """Whether it names the formulas' output (:meth:`output_labels`) rather than, or besides,
    its input's reports."""

    def output_labels(self, target: str) -> dict[str, str] | None:
        """Keys for the formulas' reports of ``target``
        (:class:`~wattflow.actors.naming.TargetNaming` adds them), or ``None``."""
        return None

    def metrics(self) -> dict[str, float]:
        """Its own figures for ``/metrics`` (``wattflow_pre_processor_<key>``)."""
        return {}
