"""What the crash drills share: wattflow killed abruptly and started again on the same state,
and the PowerReports it then wrote compared with a clean run's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from ..conftest import Service
from ..test_mongodb import identity

Document = dict[str, Any]


class Restarts:
    """One service run again and again with the same arguments, so on the same state (its
    checkpoint, its state file) and into the same outputs, as a supervisor restarts it after a
    crash. Each run logs to its own file in ``directory``: ``run1.log``, ``run2.log``…"""

    def __init__(self, directory: Path, *args: str) -> None:
        self.directory = directory
        self.args = args
        self.runs = 0

    def start(self) -> Service:
        """The next run, started: use it in a ``with`` block."""
        self.runs += 1
        return Service(self.directory / f"run{self.runs}.log", *self.args)

    @staticmethod
    def crash(run: Service) -> None:
        """SIGKILL the run, as a crash or the OOM killer ends it (no drain, no last
        checkpoint), and wait until it is gone, so that the next run never meets it."""
        run.process.kill()
        run.process.wait()


def power_of(client: MongoClient[Document], collection: str) -> dict[tuple[Any, ...], float]:
    """Each PowerReport's power by what identifies it; a report stored twice fails."""
    found = Counter[tuple[Any, ...]]()
    powers: dict[tuple[Any, ...], float] = {}
    for document in client["powerapi"][collection].find():
        key = identity(document)
        found[key] += 1
        powers[key] = float(document["power"])
    doubled = [key for key, count in found.items() if count > 1]
    assert not doubled, f"PowerReports stored twice: {doubled[:5]}"
    return powers


def assert_same_powers(
    expected: dict[tuple[Any, ...], float], got: dict[tuple[Any, ...], float]
) -> None:
    """The PowerReports of the restarted runs are exactly the clean run's: none missing, none
    it has not, each with its power (to a millionth)."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    assert not missing, f"{len(missing)} PowerReports missing, first {missing[:3]}"
    assert not extra, f"{len(extra)} PowerReports the clean run has not, first {extra[:3]}"
    differing = [
        key for key in expected if abs(got[key] - expected[key]) > 1e-6 * max(1, expected[key])
    ]
    assert not differing, f"{len(differing)} powers differ from the clean run's"
