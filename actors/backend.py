"""What inputs and outputs share: the settings every ``--input`` or ``--output`` group takes."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from wattflow.formats.reports import report_kind


def split_commas(value: Any) -> Any:
    """Accept PowerAPI's comma-separated lists (``--files a.csv,b.csv``) as well as real lists:
    a list setting comes as one string from a flag or an environment variable."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CommaList = Annotated[list[str], BeforeValidator(split_commas)]
"""Names given as a list, or comma-separated on the command line and in the environment."""


class BackendConfig(BaseModel):
    """``type``, ``model`` and ``name``, as PowerAPI's groups name them.

    An unnamed backend is called ``<role>_<type>`` (``puller_csv``, ``pusher_mongodb``), the
    default names PowerAPI gives, so environment variables written for PowerAPI still match.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: ClassVar[str]

    type: str = Field(description="Backend name, e.g. `csv` or `socket`.")
    model: str = Field(
        description="Report kind this backend reads or writes.",
        json_schema_extra={"flags": ["-m", "--model"]},
    )
    name: str = Field(
        default="",
        description="Name in logs and statistics (default: <role>_<type>, as PowerAPI names it).",
        json_schema_extra={"flags": ["-n", "--name"]},
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        """A misspelt ``--model`` would match no report: an output would write nothing."""
        report_kind(value)
        return value

    @classmethod
    def example(cls) -> Self:
        """A minimal working configuration, for documentation and tests."""
        return cls.model_validate({"type": cls.model_fields["type"].default})

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, values: Any) -> Any:
        if isinstance(values, dict) and not values.get("name"):
            return {**values, "name": f"{cls.role}_{values.get('type', '')}"}
        return values
