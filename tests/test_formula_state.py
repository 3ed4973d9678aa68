"""Formula state across an upgrade: a checkpoint the previous release saved goes on as if the
service had never stopped.

Each file in ``tests/data/checkpoints/`` is a formula's state as the release before typed
states saved it (``tests/checkpoint_fixtures.py`` says how). Restored into a fresh instance,
it must give, on the rest of its stream, exactly the reports of an instance that was never
stopped; and a restart without it must not (else the test would prove nothing).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from wattflow.actors.checkpoints import (
    STATE_VERSION,
    Checkpoints,
    Saved,
    decode_checkpoint,
    encode_checkpoint,
)
from wattflow.actors.formulas.base import Formula, FormulaActor
from wattflow.actors.runtime import DeadLetters, Ledger, QueueConfig
from wattflow.formats.frames import Frame
from wattflow.formats.reports import Report

from .checkpoint_fixtures import CHECKPOINT_FILE, DIRECTORY, Case, cases, run

CASES = {case.name: case for case in cases()}


def never_stopped(case: Case) -> list[Report]:
    """What an instance that read the whole stream reports after the checkpoint's cut."""
    formula = case.fresh()
    run(formula, case.before)
    return run(formula, case.after, flush=True)


def previous_release_left(case: Case) -> list[Report]:
    """What an instance of the previous release restored after the cut must report: what one
    that never stopped reports after the cut, or, where the previous release had reported
    fewer of the first part (:attr:`Case.reported_before`), all it had not reported yet."""
    if case.reported_before is None:
        return never_stopped(case)
    whole = run(case.fresh(), [*case.before, *case.after], flush=True)
    return whole[case.reported_before :]


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_the_previous_release_goes_on_as_if_never_stopped(name: str) -> None:
    case = CASES[name]
    expected = previous_release_left(case)
    restored = case.fresh()
    restored.restore(case.saved())
    assert run(restored, case.after, flush=True) == expected
    assert run(case.fresh(), case.after, flush=True) != expected, "the state changes nothing"


@pytest.mark.parametrize("name", list(CASES))
def test_the_state_saved_now_goes_on_as_if_never_stopped(name: str) -> None:
    """The state today's code saves, through a checkpoint's encoding, restores as well."""
    case = CASES[name]
    first = case.fresh()
    run(first, case.before)
    saved = decode_checkpoint(encode_checkpoint({"version": STATE_VERSION, "s": first.state()}))
    assert saved is not None
    restored = case.fresh()
    restored.restore(saved["s"])
    assert run(restored, case.after, flush=True) == run(first, case.after, flush=True)


@pytest.mark.parametrize("name", list(CASES))
def test_a_restored_state_is_saved_again_as_the_never_stopped_one_is(name: str) -> None:
    """Nothing of the previous release's state is lost or changed on the way in: the restored
    instance saves what the instance that never stopped saves."""
    case = CASES[name]
    restored = case.fresh()
    restored.restore(case.saved())
    if case.reported_before is not None:  # it holds more than this release would: saved whole
        again = case.fresh()
        again.restore(orjson.loads(orjson.dumps(restored.state())))
        assert run(again, case.after, flush=True) == previous_release_left(case)
        return
    first = case.fresh()
    run(first, case.before)
    assert orjson.loads(orjson.dumps(restored.state())) == orjson.loads(orjson.dumps(first.state()))


async def _nowhere(produced: list[Report | Frame]) -> None:
    del produced


def restored_by_actor(case: Case, data: bytes, caplog: pytest.LogCaptureFixture) -> Formula[Any]:
    """The instance a formula actor creates for the case's key, its state taken from the
    checkpoint ``data`` as a run takes it (its warnings captured)."""
    actor = FormulaActor(case.formula, case.config, queue=QueueConfig(), ledger=Ledger(),
                         dead_letters=DeadLetters(), dispatch=_nowhere)  # fmt: skip
    actor.checkpoints = Checkpoints(None, 60.0, 1)
    actor.checkpoints.restore(data)
    with caplog.at_level(logging.WARNING):
        return actor.instance(case.key)


def test_a_state_file_of_the_previous_release_restores_every_formula(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole checkpoint, as ``--state-file`` saved it: each formula actor hands its
    instance the state, which goes on as if never stopped."""
    data = (DIRECTORY / CHECKPOINT_FILE).read_bytes()
    restored = [case for case in CASES.values() if case.in_checkpoint]
    assert {case.formula.name for case in restored} == {
        "smartwatts",
        "rapl",
        "gpu",
        "node",
        "energy",
    }
    for case in restored:
        instance = restored_by_actor(case, data, caplog)
        assert "not restored" not in caplog.text
        assert run(instance, case.after, flush=True) == previous_release_left(case), case.name


# --- refused whole: a state of another version, or one that does not fit --------------------

REFUSED_VERSION = {
    "smartwatts": "SmartWatts formula state of version 99, not 1",
    "smartwatts-compat": "SmartWatts formula state of version 99, not 1",
    "rapl": "RAPL formula state of version 99, not 1",
    "gpu": "GPU formula state of version 99, not 2",
    "gpu-sharing": "GPU formula state of version 99, not 2",
    "node": "node formula state of version 99, not 1",
    "energy": "energy formula state of version 99, not 1",
}
"""What each formula says of a state of a later release's version."""


def holding(case: Case) -> tuple[Formula[Any], Saved]:
    """An instance that read the stream's first part, and what it would save now."""
    formula = case.fresh()
    run(formula, case.before)
    return formula, formula.state()


def assert_untouched(case: Case, formula: Formula[Any], held: Saved) -> None:
    """The instance holds what it held, and goes on as one never stopped."""
    assert formula.state() == held
    assert run(formula, case.after, flush=True) == never_stopped(case)


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_a_later_version_is_refused_and_the_instance_keeps_what_it_held(
    name: str,
) -> None:
    case = CASES[name]
    formula, held = holding(case)
    later = {**case.saved(), "version": 99}
    with pytest.raises(ValueError, match=f"^{REFUSED_VERSION.get(name)}$"):
        formula.restore(later)
    assert_untouched(case, formula, held)


def _last_leaf(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The path to the last plain value of a state (not in a report's own metadata, which
    takes any value): the part a restore that is not whole would reach last."""
    items: list[tuple[str | int, Any]] = []
    if isinstance(value, dict):
        items = [(key, item) for key, item in value.items() if key != "metadata"]
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return path
    for key, item in reversed(items):
        found = _last_leaf(item, (*path, key))
        if found is not None:
            return found
    return None


def _replaced(saved: Any, path: tuple[str | int, ...], value: Any) -> Any:
    copy = orjson.loads(orjson.dumps(saved))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return copy


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_whose_last_part_does_not_fit_is_refused_whole(name: str) -> None:
    """The last value of the state is of the wrong kind: nothing before it is taken either."""
    case = CASES[name]
    formula, held = holding(case)
    saved = case.saved()
    path = _last_leaf(saved)
    assert path is not None
    with pytest.raises(ValueError, match=r"formula state of version \w+ does not fit version"):
        formula.restore(_replaced(saved, path, {"not": "a value"}))
    assert_untouched(case, formula, held)


def _packed_paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """The paths to every array of floats a state holds (``{"shape": ..., "f8": ...}``)."""
    if isinstance(value, dict):
        if set(value) == {"shape", "f8"}:
            return [path]
        return [p for key, item in value.items() for p in _packed_paths(item, (*path, key))]
    if isinstance(value, list):
        return [p for key, item in enumerate(value) for p in _packed_paths(item, (*path, key))]
    return []


@pytest.mark.parametrize("name", ["smartwatts", "smartwatts-compat", "gpu", "gpu-sharing"])
def test_an_array_whose_bytes_do_not_fill_its_shape_is_refused_whole(name: str) -> None:
    case = CASES[name]
    formula, held = holding(case)
    saved = case.saved()
    path = _packed_paths(saved)[-1]
    packed = _replaced(saved, path, {"shape": [3], "f8": "AAAAAAAAAAA="})  # 8 bytes, not 24
    with pytest.raises(ValueError, match="8 bytes for an array of shape"):
        formula.restore(packed)
    assert_untouched(case, formula, held)


def test_a_pending_tick_that_is_not_a_report_is_refused_whole() -> None:
    """The ticks still pending are hwpc-sensor's JSON: one that does not decode refuses the
    state after the models were read, and still none of it is taken."""
    case = CASES["smartwatts"]
    formula, held = holding(case)
    saved = case.saved()
    with pytest.raises(ValueError, match="saved state"):
        formula.restore({**saved, "pending": [*saved["pending"][:-1], '{"sensor": 1}']})
    assert_untouched(case, formula, held)


@pytest.mark.parametrize(
    ("value", "why"),
    [(2**70, "beyond 64 bits"), ({"_id": {"$oid": "x"}, "a\0b": 1}, "not a name MongoDB holds")],
)
def test_a_held_ticks_metadata_no_input_would_take_is_refused_whole(value: Any, why: str) -> None:
    """The GPU formula's held ticks carry their report's own metadata on to their reports;
    metadata an input would have refused (a damaged or hand-made state) refuses the state, as
    its outputs could not write it."""
    case = CASES["gpu"]
    formula, held = holding(case)
    saved = orjson.loads(orjson.dumps(held))
    saved["devices"]["0"]["held"][-1]["report"]["metadata"] = {"n": value}
    with pytest.raises(ValueError, match=why):
        formula.restore(saved)
    assert_untouched(case, formula, held)


def test_a_state_saved_in_the_other_mode_is_refused() -> None:
    formula, held = holding(CASES["smartwatts"])
    with pytest.raises(ValueError, match="saved in the other mode"):
        formula.restore(CASES["smartwatts-compat"].saved())
    assert_untouched(CASES["smartwatts"], formula, held)


def test_a_refused_state_is_logged_and_its_instance_starts_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In a run, the formula actor says which instance's state was refused and why, once, and
    that instance starts from nothing: a restart never goes on from half a state."""
    case = CASES["smartwatts"]
    states = {case.key: {**case.saved(), "version": 99}}
    data = encode_checkpoint({"version": STATE_VERSION, "formulas": {"smartwatts": states}})
    instance = restored_by_actor(case, data, caplog)
    assert (
        "saved state of node not restored (ValueError: SmartWatts formula state of version 99, "
        "not 1); it starts afresh" in caplog.text
    )
    assert run(instance, case.after, flush=True) == run(case.fresh(), case.after, flush=True)


@pytest.mark.parametrize("saved", [None, [], "state", 7])
def test_a_state_that_is_not_an_object_is_refused(saved: Any) -> None:
    formula, held = holding(CASES["rapl"])
    with pytest.raises(ValueError, match=r"^RAPL formula state is not an object but "):
        formula.restore(saved)
    assert_untouched(CASES["rapl"], formula, held)
