"""Reading the deployment files as their tools read them: compose's ``.env`` and interpolation,
profiles, and the wattflow command lines inside compose, Kubernetes and systemd files.

The tests check those command lines with wattflow's own configuration parser, so a flag that is
renamed or removed in the CLI fails a test instead of a deployment.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from wattflow.service.cli import load_run_config, sensor_run_args
from wattflow.service.config import ServiceConfig

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
KUBERNETES = ROOT / "deploy" / "kubernetes"
SYSTEMD = ROOT / "deploy" / "systemd"
TOOLS = Path(sys.executable).parent
"""Where the test extra's command-line tools (hadolint, kubectl, check-jsonschema…) are."""

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


def check_wattflow_command(
    argv: Sequence[str],
    environ: Mapping[str, str],
    files: Mapping[str, Path],
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
    resolved = [str(files[token]) if token in files else token for token in rest]
    return load_run_config(resolved, dict(environ))
