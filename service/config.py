"""Service configuration: files, environment and flags, layered and validated into one model.

The layout is PowerAPI's: top-level settings (``verbose``, ``stream``, formula settings such as
``sensor-reports-frequency``), plus ``input`` and ``output`` tables of named backends, each with a
``type``. The same layout is read from a JSON file (PowerAPI's ``--config-file``), from wattflow's
own TOML file, from ``POWERAPI_*`` / ``WATTFLOW_*`` environment variables and from the command
line. Files are overridden by the environment, and both by flags.

Every error names the setting at fault in one line, so ``wattflow run`` can print it and exit 2.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from wattflow.actors.backend import CommaList
from wattflow.actors.formulas import formulas
from wattflow.actors.formulas.base import FormulaConfig
from wattflow.actors.partition import Partition
from wattflow.actors.preprocessors import preprocessors
from wattflow.actors.preprocessors.base import PreProcessorConfig
from wattflow.actors.pullers import pullers
from wattflow.actors.pullers.base import PullerConfig
from wattflow.actors.pushers import pushers
from wattflow.actors.pushers.base import PusherConfig
from wattflow.actors.registry import Registry
from wattflow.actors.runtime import QueueConfig
from wattflow.formats.errors import WattflowError

ENV_PREFIXES = ("WATTFLOW_", "POWERAPI_")
"""Environment variables read, in increasing precedence (PowerAPI's name wins)."""


class ConfigError(WattflowError):
    """A configuration that cannot run; the message names the setting at fault."""


RUN_OUTPUT = "run_store"
"""The name of the output that ``--run`` stands for."""


class ServiceConfig(BaseModel):
    """Everything ``wattflow run`` needs, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verbose: bool = Field(
        default=False,
        description="Log at DEBUG level.",
        json_schema_extra={"flags": ["-v", "--verbose"]},
    )
    stream: bool = Field(
        default=False,
        description="Follow the inputs instead of ending with them.",
        json_schema_extra={"flags": ["-s", "--stream"]},
    )
    inputs: dict[str, PullerConfig] = Field(default_factory=dict)
    outputs: dict[str, PusherConfig] = Field(default_factory=dict)
    pre_processors: dict[str, PreProcessorConfig] = Field(
        default_factory=dict,
        description="PowerAPI's pre-processors (--pre-processor k8s …), each bound to an input.",
    )
    formulas: dict[str, FormulaConfig] = Field(
        default_factory=dict, description="Enabled formulas and their settings."
    )
    run: str | None = Field(
        default=None,
        description="Record a measurement run: experiment/benchmark/settings/repetition.",
    )
    store: str | None = Field(
        default=None,
        description="Run store for --run: sqlite:///path or mongodb://host/db (default: runs.db "
        "in the user's data directory).",
    )
    export: CommaList = Field(
        default_factory=list,
        description="Export the --run in these formats (comma-separated: gpu-dir, "
        "extrap-text, extrap-json, extrap-jsonl, extrap-talpas, extrap, ross, hpctoolkit) as "
        "soon as it ends (its experiment_end event, or the service's stop), into --export-dir.",
    )
    export_dir: Path | None = Field(
        default=None,
        description="Directory --export writes into: a folder per format (see the exports page).",
    )

    @field_validator("export")
    @classmethod
    def _known_formats(cls, names: list[str]) -> list[str]:
        from wattflow.actors.exporters import known_formats  # imported for --export only

        return known_formats(names)

    @model_validator(mode="after")
    def _run_is_an_output(self) -> ServiceConfig:
        """``--run`` and its flags stand for the ``runs`` output, named ``run_store``:
        the pipeline, ``wattflow check`` and the statistics see it as one of the outputs."""
        if self.export and (self.run is None or self.export_dir is None):
            raise ValueError("--export exports the --run: give --run E/B/S/N and --export-dir DIR")
        if self.run is not None and RUN_OUTPUT not in self.outputs:
            recorder = pushers.get("runs").config_model
            # The dict is this model's own, made by its validation: filling it in is safe.
            self.outputs[RUN_OUTPUT] = recorder.model_validate(
                {"type": "runs", "name": RUN_OUTPUT, "run": self.run, "store": self.store,
                 "export": self.export, "export_dir": self.export_dir}
            )  # fmt: skip
        return self

    dead_letters: Path | None = Field(
        default=None, description="JSON Lines file that keeps every dead letter."
    )
    http_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /health, /ready and /metrics on this port (0: any free port, "
        "logged); off when unset.",
    )
    http_addr: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address the --http-port endpoint listens on; 0.0.0.0 in a container, for "
        "probes and scrapes from outside it.",
    )
    drain_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="Longest drain after SIGTERM or SIGINT: past it, the outputs stop writing "
        "(and retrying) and what they have not written becomes dead letters; the service exits "
        "at most 5 s later. Keep it under the grace period of what stops the service "
        "(Kubernetes' terminationGracePeriodSeconds, 30 s by default) minus those 5 s.",
    )
    partition: str | None = Field(
        default=None,
        description="Take only this instance's share of the sensors: i/N is partition i "
        "(0 to N-1) of N instances reading one input. A sensor's partition is the CRC-32 of "
        "its name modulo N; reports of other partitions are skipped, not dead letters.",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Worker processes, each taking the sensors whose hash falls to it (its "
        "formula state with it), for more than one core: socket, MongoDB, ZeroMQ (SUB) and "
        "file inputs. A JSON Lines output or dead-letter file gets one file per worker "
        "(name.workerJ.ext), and so does --state-file; the table and Prometheus outputs, "
        "--run, and the NVML and meter inputs need 1.",
    )
    state_file: Path | None = Field(
        default=None,
        description="File that keeps the formulas' learned state (checkpointed every few "
        "seconds and at a clean stop, restored at start), so a restart estimates at once. "
        "Without it, a MongoDB input in stream mode keeps the state in its checkpoint "
        "document; otherwise it is lost at a restart.",
    )
    state_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="Seconds between checkpoints of the formulas' state (and the inputs' "
        "positions); unset: the MongoDB input's --checkpoint-interval-s, else 5.",
    )
    target_names: Literal["on", "off"] = Field(
        default="off",
        description="on: every PowerReport whose target is a workload (a container, a pod's "
        "container, a VM, a Slurm job, a service) gains its names as metadata keys "
        "(target_kind, target_name, slurm_job, pod_uid…), the same for CPU, DRAM and GPU, "
        "so that a job's or a pod's power can be summed; other targets and every key "
        "already there are left as they are. off (the default): the documents PowerAPI "
        "writes, key for key (--target-energy names the targets all the same: it sums by "
        "name).",
    )
    queue: QueueConfig = Field(default_factory=QueueConfig)

    @field_validator("partition")
    @classmethod
    def _partition_form(cls, text: str | None) -> str | None:
        if text is None:
            return None
        return str(Partition.parse(text))

    def partition_spec(self) -> Partition | None:
        """The parsed ``--partition``, or None when this instance takes every sensor."""
        return None if self.partition is None else Partition.parse(self.partition)


def normalise(key: str) -> str:
    """Config keys are accepted with dashes (PowerAPI's JSON) or underscores (TOML)."""
    return key.strip().replace("-", "_")


def _normalise_tree(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {normalise(str(k)): _normalise_tree(v) for k, v in value.items()}
    return value


def load_file(path: Path) -> dict[str, Any]:
    """Read a JSON (PowerAPI's layout) or TOML config file.

    Raises:
        ConfigError: the file is missing or does not parse.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"--config-file {path}: {error.strerror}") from None
    # The suffix decides: .toml is TOML, anything else is PowerAPI's JSON. The error names the
    # format the file was read as, and the rule, so that `rapl.csv` given by mistake (an input
    # file, not a config) is not reported as bad CSV.
    is_toml = path.suffix.lower() == ".toml"
    try:
        data: Any = tomllib.loads(text) if is_toml else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(
            f"--config-file {path}: not valid {'TOML' if is_toml else 'JSON'} (a config file is "
            f"TOML when its name ends in .toml, else PowerAPI's JSON): {error}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: the top level must be a table of settings")
    result: dict[str, Any] = _normalise_tree(data)
    return result


def old_names(name: str, field: FieldInfo) -> list[str]:
    """The former names of a renamed setting, which still work as flags, keys and variables.

    A setting renamed (to give its unit: ``tick_lateness`` → ``tick_lateness_ms``) keeps its old
    name as a choice of its pydantic ``validation_alias``:
    ``validation_alias=AliasChoices("tick_lateness_ms", "tick_lateness")``.
    """
    alias = field.validation_alias
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
    return [c for c in choices if isinstance(c, str) and c != name]


def renamed_settings(models: Iterable[type[BaseModel]]) -> dict[str, str]:
    """Old name → current name of every renamed setting of ``models``."""
    return {
        old: name
        for model in models
        for name, field in model.model_fields.items()
        for old in old_names(name, field)
    }


def _rename(settings: Mapping[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    """``settings`` with old names replaced by the current ones (the current name winning)."""
    result: dict[str, Any] = {}
    for key, value in settings.items():
        name = renamed.get(normalise(str(key)))
        if name is None:
            result[key] = value
        elif name not in settings and name.replace("_", "-") not in settings:
            result[name] = value
    return result


def _field_names(models: list[type[BaseModel]]) -> set[str]:
    """Every setting of ``models``, under its current and its old names."""
    return {
        key
        for model in models
        for name, field in model.model_fields.items()
        for key in (name, *old_names(name, field))
    }


def load_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings from ``POWERAPI_*`` and ``WATTFLOW_*`` variables.

    ``POWERAPI_STREAM=true`` sets ``stream``; ``POWERAPI_INPUT_<NAME>_<FIELD>`` and
    ``POWERAPI_OUTPUT_<NAME>_<FIELD>`` set a field of a named input or output, and
    ``POWERAPI_PRE_PROCESSOR_<NAME>_<FIELD>`` of a pre-processor (the field is the longest
    known field name that ends the variable, so names may contain underscores; where several
    split it, a name the other variables give wins: see :func:`_splits`).
    """
    result, backend_variables = _read_variables(environ)
    if not backend_variables:
        return result
    backend_fields = {  # every backend's settings, to find where a variable's backend name ends
        group: _field_names([cls.config_model for _, cls in _registry(group).items()])
        for group in {group for _, group, _, _ in backend_variables}
    }
    splits = {
        variable: _splits(variable, group, rest, backend_fields[group])
        for variable, group, rest, _ in backend_variables
    }
    for variable, group, _, value in backend_variables:
        named = {n for other, found in splits.items() if other != variable for n, _ in found}
        name, field = max(splits[variable], key=lambda split: (split[0] in named, len(split[1])))
        result.setdefault(group, {}).setdefault(name, {})[field] = value
    return result


def _read_variables(
    environ: Mapping[str, str],
) -> tuple[dict[str, Any], list[tuple[str, str, str, str]]]:
    """The top-level settings the variables give, and each backend variable as (variable,
    group, ``<name>_<setting>`` in lower case, value), ``WATTFLOW_`` ones first."""
    top_level: dict[str, Any] = {}
    backend_variables: list[tuple[str, str, str, str]] = []
    for prefix in ENV_PREFIXES:
        for variable, value in environ.items():
            if not variable.startswith(prefix):
                continue
            key = variable[len(prefix) :].lower()
            group = next((g for g in GROUPS if key.startswith(g + "_")), None)
            if group is None:
                top_level[key] = value
            else:
                backend_variables.append((variable, group, key[len(group) + 1 :], value))
    return top_level, backend_variables


def _splits(variable: str, group: str, rest: str, fields: set[str]) -> list[tuple[str, str]]:
    """Each way a backend variable's ``<name>_<setting>`` splits into a backend's name and one
    of its settings.

    Several may: ``PULLER_SOCKET_TYPE`` is the type of the backend ``puller_socket``
    (PowerAPI's default name) or the ZeroMQ input ``puller``'s ``socket_type``.
    :func:`load_environment` takes the split whose name the other variables name too, then
    the longest setting (PowerAPI's rule).

    Raises:
        ConfigError: no setting ends the variable's name.
    """
    found = [(rest[: -len(f) - 1], f) for f in fields if rest.endswith("_" + f)]
    if not found:
        raise ConfigError(f"{variable}: no {group} setting ends this variable's name")
    return found


GROUPS = ("input", "output", "pre_processor")
"""The tables of named parts, each entry with a ``type``: PowerAPI's ``input``, ``output`` and
``pre-processor``."""


def _registry(group: str) -> Registry[Any]:
    if group == "input":
        return pullers
    return pushers if group == "output" else preprocessors


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Merge settings, later layers winning; ``input``, ``output`` and ``pre_processor``
    merge by name.

    A setting's old name counts as its current one, so that a later layer wins whichever name
    each layer gives it.
    """
    merged: dict[str, Any] = {}
    top_level = renamed_settings([ServiceConfig, *formula_settings().values()])
    for layer in layers:
        for key, value in _rename(layer, top_level).items():
            if key in GROUPS and isinstance(value, Mapping):
                table = merged.setdefault(key, {})
                for name, settings in value.items():
                    kind = dict(settings).get("type", table.get(name, {}).get("type"))
                    renamed = _backend_renames(key, kind)
                    table[name] = {
                        **_rename(table.get(name, {}), renamed),
                        **_rename(settings, renamed),
                    }
            elif normalise(key) == "queue" and isinstance(value, Mapping):
                merged[key] = {
                    **merged.get(key, {}),
                    **_rename(value, renamed_settings([QueueConfig])),
                }
            else:
                merged[key] = value
    return merged


def _backend_renames(group: str, kind: Any) -> dict[str, str]:
    """The renamed settings of a backend type, and its flags' other names; none for an
    unknown type (``build`` says why)."""
    try:
        model = _registry(group).get(str(kind)).config_model if kind else None
    except ValueError:
        return {}
    return {} if model is None else {**flag_keys(model), **renamed_settings([model])}


def flag_keys(model: type[BaseModel]) -> dict[str, str]:
    """Each other name a setting's flags give it (``d`` for ``-d``), to its name.

    PowerAPI's JSON config takes an argument under any of its names, the short one too
    (``{"type": "mongodb", "u": …, "d": …}``): a key that names a flag of the setting is that
    setting.
    """
    keys: dict[str, str] = {}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flags = extra.get("flags")
        for flag in flags if isinstance(flags, list) else []:
            key = normalise(str(flag).lstrip("-"))
            if key != name:
                keys[key] = name
    return keys


def _error_line(prefix: str, error: ValidationError) -> str:
    item = error.errors()[0]
    location = ".".join(str(p) for p in item["loc"])
    where = f"{prefix}.{location}" if prefix and location else prefix or location
    if item["type"] == "missing":
        return f"{where}: required setting is missing"
    if item["type"] == "extra_forbidden":
        return f"{where}: unknown setting"
    message = str(item["msg"]).removeprefix("Value error, ")  # pydantic's, for our own checks
    return f"{where}: {message}" if where else message


def _backend(group: str, name: str, settings: Mapping[str, Any]) -> Any:
    where = f"{group.replace('_', '-')}.{name}"
    kind = settings.get("type")
    if not kind:
        raise ConfigError(f"{where}.type: required setting is missing")
    try:
        model = _registry(group).get(str(kind)).config_model
    except ValueError as error:
        raise ConfigError(f"{where}.type: {error}") from None
    try:
        return model.model_validate({"name": name, **settings})
    except ValidationError as error:
        raise ConfigError(_error_line(where, error)) from None


def _pre_processors(
    settings: Mapping[str, Any], inputs: Mapping[str, PullerConfig]
) -> dict[str, PreProcessorConfig]:
    """The pre-processors, each bound to an existing input, at most one per input (PowerAPI's
    checks: a pre-processor renames targets, two on one input would fight over them)."""
    result: dict[str, PreProcessorConfig] = {}
    bound: dict[str, str] = {}
    for name, values in settings.items():
        config = _backend("pre_processor", name, values)
        puller = normalise(config.puller)
        if puller not in inputs:
            known = ", ".join(inputs) or "none"
            raise ConfigError(
                f"pre-processor.{name}.puller: no input named {config.puller!r} (inputs: {known})"
            )
        if puller in bound:
            raise ConfigError(
                f"pre-processor.{name}.puller: input {puller!r} already has pre-processor "
                f"{bound[puller]!r}; one per input"
            )
        bound[puller] = name
        result[name] = config.model_copy(update={"puller": puller})
    return result


def formula_settings() -> dict[str, type[FormulaConfig]]:
    """Each registered formula's config model, by formula name."""
    return {name: cls.config_model for name, cls in formulas.items()}


def build(raw: Mapping[str, Any]) -> ServiceConfig:
    """Validate layered settings into a :class:`ServiceConfig`.

    Raises:
        ConfigError: naming the first setting at fault.
    """
    formula_models = formula_settings()
    settings = _rename(raw, renamed_settings(formula_models.values()))
    inputs = {
        name: _backend("input", name, values) for name, values in settings.pop("input", {}).items()
    }
    outputs = {
        name: _backend("output", name, values)
        for name, values in settings.pop("output", {}).items()
    }
    pre_processors = _pre_processors(settings.pop("pre_processor", {}), inputs)
    top_level = set(ServiceConfig.model_fields) - {
        "inputs",
        "outputs",
        "formulas",
        "pre_processors",
    }
    _refuse_unknown(settings, formula_models, top_level)
    enabled = _enabled_formulas(settings, formula_models)
    try:
        return ServiceConfig(
            inputs=inputs,
            outputs=outputs,
            pre_processors=pre_processors,
            formulas=enabled,
            **{k: v for k, v in settings.items() if k in top_level},
        )
    except ValidationError as error:
        raise ConfigError(_error_line("", error).replace("_", "-")) from None


def _refuse_unknown(
    settings: Mapping[str, Any],
    formula_models: Mapping[str, type[FormulaConfig]],
    top_level: set[str],
) -> None:
    """What is left once the backends are taken out is the service's own settings, the
    formulas' and their ``disable-NAME-formula`` flags: anything else is a typo, refused
    rather than ignored.

    Raises:
        ConfigError: naming the first unknown setting.
    """
    formula_keys = _field_names(list(formula_models.values()))
    disabled = {f"disable_{name}_formula" for name in formula_models}
    for key in settings:
        if key not in formula_keys | disabled | top_level:
            raise ConfigError(f"{key.replace('_', '-')}: unknown setting")


def _enabled_formulas(
    settings: Mapping[str, Any], formula_models: Mapping[str, type[FormulaConfig]]
) -> dict[str, FormulaConfig]:
    """Each formula not disabled, validated from the settings its model has (formulas share
    the flat namespace of settings, as PowerAPI's do).

    Raises:
        ConfigError: naming the first setting a formula refuses.
    """
    enabled: dict[str, FormulaConfig] = {}
    for name, model in formula_models.items():
        if _truthy(settings.get(f"disable_{name}_formula", False), f"disable-{name}-formula"):
            continue
        values = {k: settings[k] for k in model.model_fields if k in settings}
        try:
            enabled[name] = model.model_validate(values)
        except ValidationError as error:
            raise ConfigError(_error_line("", error).replace("_", "-")) from None
    return enabled


def _truthy(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")
