"""The reference pages: one per input, output and formula, fresh, and true to the command line.

The blocks between the markers in ``docs/`` are written by ``python scripts/reference_docs.py``
from the config models; these tests fail when a committed block differs from what the models make
now, and check every flag, key, variable and example of the tables against ``wattflow run``.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from wattflow.actors.formulas import formulas
from wattflow.actors.pullers import pullers
from wattflow.actors.pushers import pushers
from wattflow.service import config as service_config
from wattflow.service.cli import _backend_parser, _global_parser, load_run_config, parse_run_args

ROOT = Path(__file__).resolve().parent.parent
FIX = "python scripts/reference_docs.py"


def _load_script() -> ModuleType:
    path = ROOT / "scripts" / "reference_docs.py"
    spec = importlib.util.spec_from_file_location("reference_docs", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


docs = _load_script()
PAGES: list[Any] = docs.pages()
BY_PATH = {page.path: page for page in PAGES}
TABLES = [page for page in PAGES if page.settings]


def test_every_input_output_and_formula_has_a_committed_page() -> None:
    expected = [f"docs/backends/input-{name}.md" for name in pullers.names()]
    expected += [f"docs/backends/output-{name}.md" for name in pushers.names()]
    expected += [f"docs/formulas/{name}.md" for name, _ in formulas.items()]
    expected += ["docs/reference/service.md", "docs/backends/README.md", "docs/formulas/README.md"]
    missing_from_script = [path for path in expected if path not in BY_PATH]
    assert not missing_from_script, f"the script makes no page for {missing_from_script}"
    missing = [path for path in expected if not (ROOT / path).is_file()]
    assert not missing, f"no page for {missing}: run `{FIX}` and commit the pages"


@pytest.mark.parametrize("page", PAGES, ids=[page.path for page in PAGES])
def test_committed_block_is_what_the_models_make(page: Any) -> None:
    current = docs.read(ROOT / page.path)
    assert current is not None, f"{page.path} is missing: run `{FIX}`"
    assert docs.BEGIN in current, f"{page.path} has no generated block: run `{FIX}`"
    assert docs.END in current, f"{page.path}: its generated block has no end marker"
    fresh = docs.render(current, page.title, page.block)
    diff = "".join(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            fresh.splitlines(keepends=True),
            f"{page.path} (committed)",
            f"{page.path} (from the models)",
            n=1,
        )
    )
    assert fresh == current, (
        f"{page.path}: the generated block is stale; run `{FIX}`\n{diff[:4000]}"
    )


def _tokens(page: Any, flag: str, takes_value: bool) -> list[str]:
    value = ["x7"] if takes_value else []
    if page.group is None:
        return [flag, *value]
    return [f"--{page.group}", page.kind, flag, *value]


def _set_by(page: Any, key: str | None, layer: dict[str, Any], config_file: Path | None) -> Any:
    """What a flag set, found under the setting's config key."""
    if key is None:
        return config_file
    if page.group is not None:
        (name, settings), *_ = layer[page.group].items()
        return name if key == "name" else settings[key]
    if key.startswith("queue."):
        return layer["queue"][key.removeprefix("queue.")]
    return layer[key]


@pytest.mark.parametrize("page", TABLES, ids=[page.path for page in TABLES])
def test_every_flag_in_the_table_sets_its_key(page: Any) -> None:
    for setting in page.settings:
        for flag in [*setting.flags, *setting.old_flags]:
            layer, config_file = parse_run_args(_tokens(page, flag, setting.takes_value))
            found = _set_by(page, setting.key, layer, config_file)
            expected: Any = True if not setting.takes_value else "x7"
            if setting.key is None:
                expected = Path("x7")
            elif page.group is not None and setting.key == "name":
                expected = "x7"
            assert found == expected, f"{page.path}: {flag} does not set {setting.key}"


def _options(parser: Any) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize(
    "page", [p for p in TABLES if p.group], ids=[p.path for p in TABLES if p.group]
)
def test_a_backend_table_lists_every_flag_its_parser_takes(page: Any) -> None:
    in_table = {flag for s in page.settings for flag in [*s.flags, *s.old_flags]}
    assert in_table == _options(_backend_parser(page.group, page.kind)) - {"--help"}


def test_the_service_and_formula_tables_list_every_global_flag() -> None:
    pages = [BY_PATH["docs/reference/service.md"]]
    pages += [BY_PATH[f"docs/formulas/{name}.md"] for name, _ in formulas.items()]
    in_tables = {flag for page in pages for s in page.settings for flag in [*s.flags, *s.old_flags]}
    assert in_tables == _options(_global_parser()) - {"-h", "--help"}


FORMULA_PAGES = [BY_PATH[f"docs/formulas/{name}.md"] for name, _ in formulas.items()]


def test_no_formula_flag_is_also_a_flag_of_an_input_or_an_output() -> None:
    """What lets the formula pages say their flags work after any group: a group keeps only its
    own flags, so a formula flag that a backend also had would be taken by that backend."""
    formula_flags = {f for page in FORMULA_PAGES for s in page.settings for f in s.flags}
    for page in (p for p in TABLES if p.group):
        shared = formula_flags & _options(_backend_parser(page.group, page.kind))
        assert not shared, f"{page.path}: {sorted(shared)} is also a formula flag"


@pytest.mark.parametrize("page", FORMULA_PAGES, ids=[page.path for page in FORMULA_PAGES])
def test_a_formula_flag_after_the_groups_sets_what_it_sets_before_them(page: Any) -> None:
    """The README puts SmartWatts' flags after ``--output``; the pages say that works."""
    groups = ["--input", "csv", "--files", "a.csv", "--output", "jsonl", "--file", "o.jsonl"]
    for setting in (s for s in page.settings if s.key is not None and s.takes_value):
        flag = setting.flags[0]
        before, _ = parse_run_args([flag, "7", *groups])
        after, _ = parse_run_args([*groups, flag, "7"])
        assert after == before, f"{page.path}: {flag} after --output sets {after}"
        assert before[setting.key.replace("-", "_")] == "7"


def test_a_global_flag_that_a_group_also_has_belongs_to_the_group() -> None:
    """The service page's one exception: ``-s`` after ``--output virtiofs`` is its suffix."""
    virtiofs = ["--output", "virtiofs", "-r", "(x)", "-d", "root"]
    layer, _ = parse_run_args(["-s", *virtiofs])
    assert layer["stream"] is True
    assert "vm_directory_name_suffix" not in layer["output"]["pusher_virtiofs"]
    layer, _ = parse_run_args([*virtiofs, "-s", "/"])
    assert "stream" not in layer
    assert layer["output"]["pusher_virtiofs"]["vm_directory_name_suffix"] == "/"


@pytest.mark.parametrize("page", TABLES, ids=[page.path for page in TABLES])
def test_every_variable_in_the_table_sets_its_key(page: Any, tmp_path: Path) -> None:
    for setting in page.settings:
        for variable in [v for v in [setting.env, *setting.old_envs] if v]:
            if setting.key is None:  # the config file: read before the other variables
                path = tmp_path / "wattflow.toml"
                path.write_text("stream = true\n", encoding="utf-8")
                assert load_run_config([], environ={variable: str(path)}).stream
                continue
            name = f"{'PULLER' if page.group == 'input' else 'PUSHER'}_{str(page.kind).upper()}"
            layer = service_config.load_environment({variable.replace("<NAME>", name): "x7"})
            if page.group is not None:
                # an old name's variable sets the current key once the backend's type is known
                typed = {page.group: {name.lower(): {"type": page.kind}}}
                merged = service_config.merge(typed, layer)
                assert merged[page.group][name.lower()][setting.key] == "x7", variable
            else:
                merged = service_config.merge(layer)
                assert merged[setting.key] == "x7", f"{variable} does not set {setting.key}"


@pytest.mark.parametrize("page", TABLES, ids=[page.path for page in TABLES])
def test_the_example_runs_and_its_toml_says_the_same(page: Any, tmp_path: Path) -> None:
    from_flags = load_run_config(page.example.argv, environ={})
    path = tmp_path / "wattflow.toml"
    path.write_text(page.example.toml, encoding="utf-8")
    from_file = load_run_config(["--config-file", str(path)], environ={})
    assert from_file == from_flags
    if page.group is not None:
        assert page.group in ("input", "output")
        built = from_flags.inputs if page.group == "input" else from_flags.outputs
        assert docs.backend_example_of(page.group, page.kind) in built.values()


# --- the writer ---------------------------------------------------------------------------------

BLOCK = "Generated.\n\n| a | b |"


def test_only_the_block_changes_and_the_prose_is_kept_byte_for_byte() -> None:
    page = (
        "# Title\r\n\r\nProse *before*.  \n"
        f"{docs.BEGIN}\nold block\n{docs.END}\n"
        "Prose after, without a final newline"
    )
    text = docs.render(page, "Ignored", BLOCK)
    assert text == (
        "# Title\r\n\r\nProse *before*.  \n"
        f"{docs.BEGIN}\n{BLOCK}\n{docs.END}\n"
        "Prose after, without a final newline"
    )
    assert docs.render(text, "Ignored", BLOCK) == text


def test_an_empty_block_is_filled() -> None:
    page = f"# Input: csv\n\n## Settings\n\n{docs.BEGIN}\n{docs.END}\n\nMore prose.\n"
    assert docs.render(page, "x", BLOCK) == (
        f"# Input: csv\n\n## Settings\n\n{docs.BEGIN}\n{BLOCK}\n{docs.END}\n\nMore prose.\n"
    )


def test_a_missing_page_is_created_and_a_page_without_markers_gets_the_block_appended() -> None:
    assert docs.render(None, "Input: csv", BLOCK) == (
        f"# Input: csv\n\n{docs.BEGIN}\n{BLOCK}\n{docs.END}\n"
    )
    assert docs.render("# Mine\n\nProse.", "x", BLOCK) == (
        f"# Mine\n\nProse.\n\n{docs.BEGIN}\n{BLOCK}\n{docs.END}\n"
    )


def test_check_names_the_stale_pages_and_write_makes_them_fresh(tmp_path: Path) -> None:
    assert docs.stale(tmp_path) == [page.path for page in PAGES]
    (tmp_path / "docs" / "formulas").mkdir(parents=True)
    prose = f"# GPU\n\nHand-written.\n\n{docs.BEGIN}\n{docs.END}\n\nMore.\n"
    (tmp_path / "docs" / "formulas" / "gpu.md").write_text(prose, encoding="utf-8")
    assert docs.write(tmp_path) == [page.path for page in PAGES]
    assert docs.stale(tmp_path) == []
    assert docs.write(tmp_path) == []
    gpu = (tmp_path / "docs" / "formulas" / "gpu.md").read_text(encoding="utf-8")
    assert gpu.startswith("# GPU\n\nHand-written.\n\n")
    assert gpu.endswith(f"{docs.END}\n\nMore.\n")


def test_the_pages_say_nothing_of_this_machine() -> None:
    import socket

    host = socket.gethostname()
    for page in PAGES:
        assert str(ROOT) not in page.block, page.path
        assert len(host) < 4 or host not in page.block, page.path


def test_check_exits_1_naming_the_stale_page_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert docs.main(["--check"]) == 0, "the committed pages are stale"
    gpu = BY_PATH["docs/formulas/gpu.md"]
    monkeypatch.setattr(docs, "pages", lambda: [docs.Page(gpu.path, gpu.title, "Changed.")])
    assert docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/formulas/gpu.md: stale" in err
    assert FIX in err


PROSE_DEFAULT = re.compile(r"`(--[a-z0-9-]+)` \((?:default )?(\d[\d,]*(?:\.\d+)?)( s| ms)?\)")
"""A default said in prose: ``--max-open-files`` (4096), ``--retry-for-s`` (default 300 s)."""

TO_FLAG_UNIT = {(" s", "-s"): 1.0, (" ms", "-ms"): 1.0, (" s", "-ms"): 1000.0, ("", ""): 1.0}
"""What a prose figure in a unit is multiplied by to be in the flag's unit (its name's end)."""


def _defaults(settings: list[Any]) -> dict[str, set[float]]:
    """Each flag's numeric defaults in ``settings``."""
    found: dict[str, set[float]] = {}
    for setting in settings:
        try:
            value = float(setting.default.strip("`"))
        except ValueError:
            continue
        for flag in [*setting.flags, *setting.old_flags]:
            found.setdefault(flag, set()).add(value)
    return found


ALL_DEFAULTS = _defaults([setting for page in TABLES for setting in page.settings])
PROSE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", PROSE_PAGES, ids=[str(p.relative_to(ROOT)) for p in PROSE_PAGES])
def test_a_default_said_in_prose_is_the_flags_default(path: Path) -> None:
    """The CSV output's page and operations said ``--max-open-files`` (256) when it was 4096.

    A figure in prose beside a flag must be its default: the one in the page's own table when
    the flag is there (each backend has its own ``--max-batch``), else one of those the flag
    has in any table. Figures in another unit than the flag's (``--max-line-bytes`` (1 MiB)),
    and flags of no table (a benchmark's), are not checked."""
    relative = path.relative_to(ROOT).as_posix()
    own = _defaults(BY_PATH[relative].settings) if relative in BY_PATH else {}
    wrong = []
    for flag, figure, unit in PROSE_DEFAULT.findall(path.read_text(encoding="utf-8")):
        suffix = next((end for end in ("-ms", "-s") if flag.endswith(end)), "")
        factor = TO_FLAG_UNIT.get(((unit or ""), suffix if unit else ""))
        defaults = own.get(flag) or ALL_DEFAULTS.get(flag)
        if factor is None or not defaults:
            continue
        if float(figure.replace(",", "")) * factor not in defaults:
            wrong.append(f"`{flag}` ({figure}{unit}): the default is {sorted(defaults)}")
    assert not wrong, f"{relative}: " + "; ".join(wrong)
