"""Formula state across an upgrade: a checkpoint the previous release saved goes on as if the
service had never stopped.

Each file in ``tests/data/checkpoints/`` is a formula's state as the release before typed
states saved it (``tests/checkpoint_fixtures.py`` says how). Restored into a fresh instance,
it must give, on the rest of its stream, exactly the reports of an instance that was never
stopped; and a restart without it must not (else the test would prove nothing).
"""

from __future__ import annotations

import logging

import orjson
import pytest

from wattflow.actors.checkpoints import (
    STATE_VERSION,
    Checkpoints,
    decode_checkpoint,
    encode_checkpoint,
)
from wattflow.actors.formulas.base import FormulaActor
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


@pytest.mark.parametrize("name", list(CASES))
def test_a_state_of_the_previous_release_goes_on_as_if_never_stopped(name: str) -> None:
    case = CASES[name]
    expected = never_stopped(case)
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
    first = case.fresh()
    run(first, case.before)
    restored = case.fresh()
    restored.restore(case.saved())
    assert orjson.loads(orjson.dumps(restored.state())) == orjson.loads(orjson.dumps(first.state()))


async def _nowhere(produced: list[Report | Frame]) -> None:
    del produced


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
        actor = FormulaActor(case.formula, case.config, queue=QueueConfig(), ledger=Ledger(),
                             dead_letters=DeadLetters(), dispatch=_nowhere)  # fmt: skip
        actor.checkpoints = Checkpoints(None, 60.0, 1)
        actor.checkpoints.restore(data)
        with caplog.at_level(logging.WARNING):
            instance = actor.instance(case.key)
        assert "not restored" not in caplog.text
        assert run(instance, case.after, flush=True) == never_stopped(case), case.name
