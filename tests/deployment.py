"""Reading the deployment files as their tools read them: compose's ``.env`` and interpolation,
profiles, and the wattflow command lines inside compose, Kubernetes and systemd files.

The tests check those command lines with wattflow's own configuration parser, so a flag that is
renamed or removed in the CLI fails a test instead of a deployment.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from wattflow.actors.pushers import pushers
from wattflow.service.cli import _global_parser, load_run_config, sensor_run_args
from wattflow.service.config import ServiceConfig

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
KUBERNETES = ROOT / "deploy" / "kubernetes"
SYSTEMD = ROOT / "deploy" / "systemd"
TOOLS = Path(sys.executable).parent
"""Where the test extra's command-line tools (hadolint, kubectl, check-jsonschema…) are."""

PENDING_FLAGS = {"--http-port": 1, "--http-addr": 1}
"""``wattflow run`` flags the deployment files use before the CLI has them (the HTTP endpoint
for /health, /ready and /metrics), with how many values each takes. While the CLI does not
know one, the checks leave it out; once it does, they check it like any other flag, so nothing
needs changing here when it lands (then this table may be emptied)."""

PENDING_OUTPUTS = {"prometheus"}
"""Output types the files use before wattflow has them, handled as :data:`PENDING_FLAGS`."""


def pending_flag(flag: str) -> bool:
    """A flag of :data:`PENDING_FLAGS` that ``wattflow run`` does not know yet."""
    return flag in PENDING_FLAGS and flag not in _global_parser()._option_string_actions


def pending_output(kind: str) -> bool:
    """An output type of :data:`PENDING_OUTPUTS` that wattflow does not have yet."""
    return kind in PENDING_OUTPUTS and kind not in pushers.names()


def without_pending(argv: Sequence[str]) -> list[str]:
    """``argv`` less the flags (with their values) and output groups not in the CLI yet."""
    result: list[str] = []
    index = 0
    dropping_group = False
    while index < len(argv):
        token = argv[index]
        if token in ("--input", "--output"):
            kind = argv[index + 1] if index + 1 < len(argv) else ""
            dropping_group = token == "--output" and pending_output(kind)
        flag = token.partition("=")[0]
        if not dropping_group and pending_flag(flag):
            index += 1 if "=" in token else 1 + PENDING_FLAGS[flag]
            continue
        if not dropping_group:
            result.append(token)
        index += 1
    return result


# --- compose ---------------------------------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<dollar>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-+?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's interpolation of ``text``, strict: a variable neither set nor defaulted is an
    error here, where compose would warn and use an empty string."""

    def value(match: re.Match[str]) -> str:
        if match["dollar"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        current = env.get(name)
        unset_or_empty = not current if op and op.startswith(":") else current is None
        if op in (":-", "-"):
            return arg if unset_or_empty else str(current)
        if op in (":+", "+"):
            return "" if unset_or_empty else arg
        if current is None:
            raise KeyError(f"${{{name}}} is used but set nowhere")
        return current

    return _VARIABLE.sub(value, text)


def interpolate_tree(value: Any, env: Mapping[str, str]) -> Any:
    """Interpolate every string of a loaded YAML document (keys left as they are)."""
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [interpolate_tree(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate_tree(item, env) for key, item in value.items()}
    return value


def read_env_file(path: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """A compose ``.env`` file: its variables (later ones may use earlier ones) and, for each,
    its documentation: the comment lines above it, which document every variable that follows
    them up to a blank line or the next comment."""
    variables: dict[str, str] = {}
    comments: dict[str, list[str]] = {}
    block: list[str] = []  # the comment lines of the current block
    after_variable = False
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            block, after_variable = [], False
        elif stripped.startswith("#"):
            if after_variable:  # a new comment after variables starts a new block
                block, after_variable = [], False
            text = stripped.lstrip("# ")
            if text and not text.startswith("---"):
                block.append(text)
        else:
            name, _, raw = stripped.partition("=")
            variables[name] = interpolate(raw, variables)
            comments[name] = list(block)
            after_variable = True
    return variables, comments


def compose_file(env: Mapping[str, str]) -> dict[str, Any]:
    """docker/compose.yml, loaded and interpolated with ``env``."""
    loaded = yaml.safe_load((DOCKER / "compose.yml").read_text())
    model: dict[str, Any] = interpolate_tree(loaded, env)
    return model


def active_services(model: Mapping[str, Any], profiles: set[str]) -> dict[str, Any]:
    """The services that ``docker compose up`` starts with ``profiles`` on."""
    return {
        name: service
        for name, service in model["services"].items()
        if not service.get("profiles") or profiles & set(service["profiles"])
    }


def bind_mounts(service: Mapping[str, Any], base: Path) -> dict[str, Path]:
    """A service's bind mounts of files or folders beside compose.yml: container path → host
    path."""
    mounts: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        source, _, rest = str(volume).partition(":")
        if source.startswith("."):
            mounts[rest.split(":")[0]] = (base / source).resolve()
    return mounts


# --- wattflow command lines -------------------------------------------------------------------


def _filtered_config(path: Path, into: Path) -> Path:
    """A copy of a wattflow config file without outputs of pending types (as JSON)."""
    data = (
        tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    )
    outputs = {
        name: settings
        for name, settings in data.get("output", {}).items()
        if not pending_output(str(settings.get("type")))
    }
    filtered = {**data, "output": outputs}
    copy = into / (path.stem + ".json")
    copy.write_text(json.dumps(filtered))
    return copy


def check_wattflow_command(
    argv: Sequence[str],
    environ: Mapping[str, str],
    files: Mapping[str, Path],
    scratch: Path,
) -> ServiceConfig:
    """Validate a ``wattflow`` command line (``run …`` or ``sensor nvml …``) as the CLI would,
    without starting it: every flag, setting, config file and ``WATTFLOW_``/``POWERAPI_``
    variable must be known and valid.

    ``files`` maps paths inside the container to files of this repository (the command's
    ``--config-file``). Raises :class:`ConfigError` naming what is wrong.
    """
    command, *rest = argv
    if command == "sensor":
        rest = sensor_run_args(rest)
    else:
        assert command == "run", f"not a `wattflow run` or `wattflow sensor` command: {argv}"
    rest = [str(files[token]) if token in files else token for token in rest]
    resolved: list[str] = []
    for index, token in enumerate(rest):
        if index and rest[index - 1] == "--config-file":
            token = str(_filtered_config(Path(token), scratch))
        resolved.append(token)
    return load_run_config(without_pending(resolved), dict(environ))
