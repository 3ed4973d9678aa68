"""hwpc-sensor's JSON lines into frames, and PowerReport frames back into JSON lines.

A frame must stand for exactly the reports the lines decode to one by one, or not be made at
all; the JSON Lines output must write a frame's PowerReports as the same bytes it writes for
those reports one by one. Both are checked against the line-by-line decoder and encoder on
generated hwpc-sensor streams, cut into batches at every kind of place, and on each kind of line
a frame cannot stand for.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import bson
import numpy as np
import orjson
import pytest

from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.smartwatts import SmartWattsConfig, SmartWattsFormula
from wattflow.formats import json_frames, powerapi
from wattflow.formats.batch import expand
from wattflow.formats.frames import Column, HWPCFrame, PowerFrame, canonical_rows
from wattflow.formats.json_frames import Layout, decode_hwpc_frames
from wattflow.formats.report_table import encode_json_lines
from wattflow.formats.reports import HWPCReport, Report

from .test_hwpc_lines import BATCH_CHANGES, MUTATIONS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record


@pytest.fixture(autouse=True, params=["C parser", "Python only"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test both ways: with the C parser of hwpc-sensor's lines, as wattflow runs where it
    was built, and without it (the Python way alone), as where no C compiler built it."""
    assert json_frames.c_parser_built(), "the C parser is built where the tests run"
    if request.param == "Python only":
        monkeypatch.setattr(json_frames, "_hwpc_lines", None)
        assert not json_frames.c_parser_built()
    return str(request.param)


def stream(tmp_path: Path, **shape: Any) -> list[bytes]:
    """A generated hwpc-sensor stream, as the lines of its JSON Lines file."""
    path = tmp_path / "hwpc.jsonl"
    record(jsonl=path, **{"ticks": 12, "containers": 5, **shape})
    return path.read_bytes().splitlines()


def one_by_one(lines: list[bytes]) -> list[Report]:
    reports, errors = powerapi.decode_json_lines(HWPCReport, lines, "test", 1)
    assert errors == []
    return reports


def by_sensor(reports: list[Report]) -> list[Report]:
    """Reports in each sensor's order, sensor after sensor in the order they first come (a
    frame holds one sensor)."""
    first = {report.sensor: at for at, report in reversed(list(enumerate(reports)))}
    return sorted(reports, key=lambda report: first[report.sensor])


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"sockets": 1, "cpus_per_socket": 8},
        {"sensors": ("node-1", "node-2", "node-3")},
        {"multiplex": 0.3, "containers": 20},
    ],
)
@pytest.mark.parametrize("batch_lines", [1, 7, 50, 10_000])
def test_frames_stand_for_the_reports_the_lines_decode_to(
    tmp_path: Path, shape: dict[str, Any], batch_lines: int, decoder: str
) -> None:
    """Cut anywhere (mid-tick, before the global report, one line at a time), batch after
    batch with what the input remembers of its sensors: the same reports, byte for byte. The
    C parser makes the frames of every batch but a sensor's first when it starts mid-tick."""
    lines = stream(tmp_path, **shape)
    layouts: dict[str, Layout] = {}
    framed: list[Report] = []
    expected: list[Report] = []
    by_c_parser = batches = 0
    for start in range(0, len(lines), batch_lines):
        batch = lines[start : start + batch_lines]
        batches += 1
        by_c_parser += json_frames.compiled_hwpc_frames(batch, dict(layouts)) is not None
        frames = decode_hwpc_frames(batch, layouts)
        assert frames is not None, f"a plain batch at line {start + 1}"
        assert all(len(frame) == len(frame.reports()) for frame in frames)
        for frame in frames:
            assert len(frame.sensors()) == 1
            assert frame.canonical, "the decoder promises canonical rows"
            assert canonical_rows(frame.tables)
        framed += [report for frame in frames for report in frame.reports()]
        expected += by_sensor(one_by_one(batch))
    assert encode_json_lines(framed) == encode_json_lines(expected)
    assert sum(len(frame) for frame in decode_hwpc_frames(lines) or []) == len(lines)
    sensors = len(shape.get("sensors", ("node-1",)))
    if decoder == "C parser":
        assert by_c_parser >= batches - sensors
    else:
        assert by_c_parser == 0


def _change(lines: list[bytes], at: int, change: Any) -> list[bytes]:
    document = json.loads(lines[at])
    change(document)
    return [*lines[:at], json.dumps(document).encode(), *lines[at + 1 :]]


def _first_cpu(document: dict[str, Any]) -> dict[str, Any]:
    group = next(iter(document["groups"].values()))
    socket = next(iter(group.values()))
    cpu: dict[str, Any] = next(iter(socket.values()))
    return cpu


def _rename_socket(document: dict[str, Any], name: str = "00") -> None:
    group = document["groups"]["core"]
    group[name] = group.pop("0")


CHANGES = {
    "not JSON": lambda lines: [*lines[:3], b'{"timestamp": ', *lines[4:]],
    "metadata": lambda lines: _change(lines, 3, lambda d: d.update(metadata={"k": 1})),
    "a float counter": lambda lines: _change(
        lines, 3, lambda d: _first_cpu(d).update(time_enabled=1.5)
    ),
    "a counter beyond 64 bits": lambda lines: _change(
        lines, 3, lambda d: _first_cpu(d).update(time_enabled=10**40)
    ),
    "a missing event": lambda lines: _change(lines, 3, lambda d: _first_cpu(d).popitem()),
    "an extra event": lambda lines: _change(lines, 3, lambda d: _first_cpu(d).update(X=1)),
    "a socket written 00": lambda lines: _change(lines, 3, _rename_socket),
    "a socket written -1": lambda lines: _change(lines, 3, lambda d: _rename_socket(d, "-1")),
    "a socket number beyond 64 bits": lambda lines: _change(
        lines, 3, lambda d: _rename_socket(d, str(2**64))
    ),
    "a timestamp going back": lambda lines: [*lines[:3], lines[0], *lines[4:]],
    "a second report of a target in its tick": lambda lines: [*lines[:4], lines[3], *lines[4:]],
    "a timestamp finer than a millisecond": lambda lines: _change(
        lines, 3, lambda d: d.update(timestamp=d["timestamp"] + "5")
    ),
    "no groups": lambda lines: _change(lines, 3, lambda d: d.update(groups={})),
    "a boolean counter": lambda lines: _change(
        lines, 3, lambda d: _first_cpu(d).update(time_enabled=True)
    ),
    "a cpu without events, the first of its group": lambda lines: _change(
        lines, 1, lambda d: _first_cpu(d).clear()
    ),
    "bytes not UTF-8 in a name": lambda lines: [
        *lines[:3],
        lines[3].replace(b'"target":"', b'"target":"\xff', 1),
        *lines[4:],
    ],
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_batch_with_a_line_the_frame_cannot_stand_for_is_left_to_the_lines(
    tmp_path: Path, change: Any
) -> None:
    lines = change(stream(tmp_path))
    assert decode_hwpc_frames(lines) is None
    assert decode_hwpc_frames(lines[10:]) is not None, "the rest of the stream is plain"


def test_a_line_not_utf8_is_a_dead_letter_and_the_others_reports(tmp_path: Path) -> None:
    """The socket input reads what the network brings: bytes that are not UTF-8 in a string
    make that line a dead letter, with its number, and the batch's other lines reports."""
    lines = stream(tmp_path)
    lines[3] = lines[3].replace(b'"target":"', b'"target":"\xff', 1)
    decoded, errors = json_frames.decode_json_batch(HWPCReport, lines, "test", 1)
    assert [(error.line, raw) for error, raw in errors] == [(4, lines[3])]
    assert "not valid JSON" in str(errors[0][0])
    assert decoded == one_by_one([*lines[:3], *lines[4:]])


def _changed(change: Any) -> Any:
    """A mutation of a line's document, as the C parser's tests write them."""

    def mutate(line: bytes, rng: random.Random) -> bytes:
        document = json.loads(line)
        change(document, rng)
        return json.dumps(document).encode()

    return mutate


def _first_counters(document: dict[str, Any]) -> dict[str, Any]:
    sockets = next(iter(document["groups"].values()))
    counters: dict[str, Any] = next(iter(next(iter(sockets.values())).values()))
    return counters


WRONG: tuple[Any, ...] = ([], {}, None, True, 1, 1.5, "x", "", [1], {"0": []}, {"0": {"0": 1}})
"""Values of every JSON kind, and nested shapes, for a field that expects another."""

SHAPES = {
    **MUTATIONS,
    "a timestamp a zone moves off the calendar": _changed(
        lambda document, rng: document.update(
            timestamp=rng.choice(["9999-12-31T23:59:59.999-01:00", "0001-01-01T00:00:00+01:00"])
        )
    ),
    "a timestamp of any form": _changed(
        lambda document, rng: document.update(
            timestamp=rng.choice([1e308, -1e308, 2**63, "1" * 400, "nan", "-", *WRONG])
        )
    ),
    "a sensor or target of another kind": _changed(
        lambda document, rng: document.update({rng.choice(["sensor", "target"]): rng.choice(WRONG)})
    ),
    "groups of another shape": _changed(
        lambda document, rng: document.update(groups=rng.choice(WRONG))
    ),
    "a socket of another shape": _changed(
        lambda document, rng: next(iter(document["groups"].values())).update(
            {"0": rng.choice(WRONG)}
        )
    ),
    "counters of another shape": _changed(
        lambda document, rng: _first_counters(document).update(E=rng.choice([*WRONG, 1e308]))
    ),
    "metadata of another shape": _changed(
        lambda document, rng: document.update(
            metadata=rng.choice(
                [*WRONG, {"a": [1]}, {"run": 2**64}, {"a\0b": 1}, {"a": [[[[[[1]]]]]] * 9}]
            )
        )
    ),
    "a field missing": _changed(
        lambda document, rng: document.pop(rng.choice(["timestamp", "sensor", "target", "groups"]))
    ),
    "a document of another kind": lambda line, rng: json.dumps(rng.choice(WRONG)).encode(),
    "deep nesting": lambda line, rng: b"[" * rng.choice([100, 300, 10_000]),
}
"""What a line may become in the mutation sweep: the C parser's tests' mutations (every way a
line can differ from hwpc-sensor's form, random bytes and bytes that are not UTF-8 included),
and every field of another kind or shape."""


def test_any_mutated_batch_becomes_reports_and_dead_letters_never_an_error(
    tmp_path: Path,
) -> None:
    """A sweep of 300 batches of two sensors' lines, each with one to three lines mutated or
    moved: decoding never raises, and every line that is not blank is a report (given back by
    its frame, or alone) or a dead letter naming its line and holding it. Before, a timestamp
    that its zone moves past year 9999 or before year 1 raised OverflowError out of the
    decoder, which stopped the input; a frame counted a report whose only group was empty but
    never gave it back; and every report can be written as JSON and as BSON (a counter or a
    metadata integer beyond 64 bits passed, then failed the outputs with their whole batch)."""
    lines = stream(tmp_path, ticks=6, containers=3, sensors=("node-1", "node-2"))
    rng = random.Random(3)
    off_calendar = 0
    for _ in range(300):
        start = rng.randrange(len(lines))
        batch: list[Any] = list(lines[start : start + rng.randint(1, 20)])
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(batch))
            try:
                if rng.random() < 0.85:
                    batch[at] = rng.choice(list(SHAPES.values()))(batch[at], rng)
                else:
                    batch = rng.choice(list(BATCH_CHANGES.values()))(batch, at, rng) or batch
            except (ValueError, LookupError, TypeError, AttributeError, StopIteration):
                pass  # a mutation that needs what an earlier one broke (JSON, an event)
        decoded, errors = json_frames.decode_json_batch(HWPCReport, batch, "test", 1, {})
        reports = expand(decoded)
        filled = [line for line in batch if line.strip()]
        assert len(reports) + len(errors) == len(filled)
        for report in reports:
            assert powerapi.encode_json(report)
            assert bson.encode(powerapi.to_mongodb(report))
        for error, raw in errors:
            assert error.source == "test"
            assert error.line is not None
            assert raw is batch[error.line - 1]
        off_calendar += any("out of range in UTC" in str(error) for error, _ in errors)
    assert off_calendar >= 3, "the sweep moves timestamps off the calendar"


def test_a_report_with_an_empty_group_is_given_back_as_it_came(tmp_path: Path) -> None:
    """A container's report whose group holds no socket (``"core": {}``), after reports that
    named the group: no frame row could stand for it, so the batch goes line by line and the
    report comes back, its empty group with it (a frame counted it and lost it before)."""
    lines = stream(tmp_path)
    document = json.loads(lines[8])
    assert document["target"] != "all"
    lines[8] = json.dumps(document | {"groups": {"core": {}}}).encode()
    decoded, errors = json_frames.decode_json_batch(HWPCReport, lines, "test", 1, {})
    assert errors == []
    assert expand(decoded) == one_by_one(lines)
    assert expand(decoded)[8].groups == {"core": {}}  # type: ignore[attr-defined]


def renumbered(line: bytes, socket: str | None = None, cpu: str | None = None) -> bytes:
    """The line with its first group's first socket, or that socket's first cpu, renumbered."""
    document = json.loads(line)
    sockets = next(iter(document["groups"].values()))
    if cpu is not None:
        cpus = next(iter(sockets.values()))
        cpus[cpu] = cpus.pop(next(iter(cpus)))
    if socket is not None:
        sockets[socket] = sockets.pop(next(iter(sockets)))
    return json.dumps(document).encode()


def test_sockets_and_cpus_out_of_bounds_are_dead_letters_and_the_others_reports(
    tmp_path: Path,
) -> None:
    """A socket from 65,536 on or a cpu from 1,048,576 on (SmartWatts would size arrays by
    them): that line is refused with the key in its reason, the batch's other lines are
    reports, as one by one, and the largest numbers within bounds are reports too."""
    lines = stream(tmp_path)
    lines[3] = renumbered(lines[3], socket=str(10**18))
    lines[6] = renumbered(lines[6], cpu=str(2**40))
    lines[8] = renumbered(lines[8], socket="-1")
    lines[9] = renumbered(lines[9], socket="65535", cpu="1048575")
    decoded, errors = json_frames.decode_json_batch(HWPCReport, lines, "test", 1)
    assert [(error.line, raw) for error, raw in errors] == [
        (4, lines[3]),
        (7, lines[6]),
        (9, lines[8]),
    ]
    assert f"socket '{10**18}' of group" in str(errors[0][0])
    assert "(0 to 65535)" in str(errors[0][0])
    assert f"cpu '{2**40}' of socket" in str(errors[1][0])
    assert "(0 to 1048575)" in str(errors[1][0])
    assert "socket '-1' of group" in str(errors[2][0])
    assert decoded == one_by_one([*lines[:3], *lines[4:6], lines[7], *lines[9:]])
    report = decoded[6]  # line 10's
    assert isinstance(report, HWPCReport)
    assert "1048575" in next(iter(report.groups.values()))["65535"]


def test_a_sensor_whose_groups_change_is_learned_again(tmp_path: Path) -> None:
    lines = stream(tmp_path)
    layouts: dict[str, Layout] = {}
    assert decode_hwpc_frames(lines[:20], layouts) is not None
    assert [name for name, _ in layouts["node-1"].groups] == ["rapl", "msr", "core"]
    renamed: list[bytes] = []
    for document in map(json.loads, lines[20:]):
        groups = document["groups"]
        if "msr" in groups:  # the global report: its msr group is now named extra
            document["groups"] = {name.replace("msr", "extra"): groups[name] for name in groups}
        renamed.append(json.dumps(document).encode())
    frames = decode_hwpc_frames(renamed, layouts)
    assert frames is not None
    assert [name for name, _ in layouts["node-1"].groups] == ["rapl", "extra", "core"]
    framed = [report for frame in frames for report in frame.reports()]
    assert framed == one_by_one(renamed)


def test_a_sensors_frames_share_their_names_batch_after_batch(tmp_path: Path) -> None:
    """Cut mid-tick, batch after batch: each frame of a sensor has the names of the one before
    it (the same list, unless the batch brought new names, which come after them), so that
    SmartWatts joins it onto the ticks it holds without coding names again."""
    lines = stream(tmp_path, containers=8)
    layouts: dict[str, Layout] = {}
    previous: HWPCFrame | None = None
    grew = 0
    for start in range(0, len(lines), 7):
        for frame in decode_hwpc_frames(lines[start : start + 7], layouts) or []:
            if previous is not None:
                assert frame.names[: len(previous.names)] == previous.names
                if len(frame.names) == len(previous.names):
                    assert frame.names is previous.names
                else:
                    grew += 1
                joined = previous.joined(frame)
                assert joined.names is frame.names
                assert joined.reports() == [*previous.reports(), *frame.reports()]
            previous = frame
    assert 0 < grew < 5, "the first batches bring the targets' names, the others none"
    assert layouts["node-1"].names is previous.names if previous else False


def test_a_sensor_with_ever_new_targets_is_remembered_up_to_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Containers that keep coming under new names: the names an input remembers of a sensor
    stop at ``NAMES_LIMIT`` (the next batch codes its names afresh), and every frame still
    stands for its lines' reports; a frame joined onto one coded afresh keeps the newer
    frame's names, followed by those it lacks."""
    monkeypatch.setattr(json_frames, "NAMES_LIMIT", 12)
    renamed: list[bytes] = []
    for at, line in enumerate(stream(tmp_path, ticks=20)):
        document = json.loads(line)
        if document["target"] not in ("all", "system"):
            document["target"] += f"-{at}"
        renamed.append(json.dumps(document).encode())
    layouts: dict[str, Layout] = {}
    pending: HWPCFrame | None = None
    afresh = 0
    for start in range(0, len(renamed), 5):
        batch = renamed[start : start + 5]
        frames = decode_hwpc_frames(batch, layouts)
        assert frames is not None
        assert len(layouts["node-1"].names) <= 12
        assert [r for f in frames for r in f.reports()] == one_by_one(batch)
        for frame in frames:
            if pending is not None:
                afresh += frame.names[: len(pending.names)] != pending.names
                joined = pending.joined(frame)
                assert joined.names[: len(frame.names)] == frame.names
                assert joined.reports() == [*pending.reports(), *frame.reports()]
            pending = frame
    assert afresh > 0, "some batch coded its names afresh"


def test_power_frames_are_written_as_their_reports_are(tmp_path: Path) -> None:
    """SmartWatts' frames of a generated stream, and a frame of the floats JSON writes in
    other forms, give the JSON Lines output the same bytes as their reports."""
    lines = stream(tmp_path, ticks=40, multiplex=0.2)
    config = SmartWattsConfig(learn_min_samples_required=5)
    SmartWattsFormula.prepare(config)
    layouts: dict[str, Layout] = {}
    outputs: list[PowerFrame] = []
    formula = SmartWattsFormula(config, "node-1")
    for start in range(0, len(lines), 60):
        for frame in decode_hwpc_frames(lines[start : start + 60], layouts) or []:
            out = Output()
            batch: list[Any] = [frame]  # a frame travels alone, as the runtime hands it on
            formula.process(batch, out)
            outputs += [item for item in out.items() if isinstance(item, PowerFrame)]
    assert len(outputs) > 1, "SmartWatts made frames of PowerReports"
    assert sum(map(len, outputs)) > 100
    specials = np.array([0.0, -0.0, 1e-7, 123456789.123, 1e300, float("nan"), float("inf"), 0.1])
    outputs.append(
        PowerFrame(
            sensor='sensor "1"',
            millis=np.arange(8, dtype=np.int64) * 1000,
            targets=np.array([0, 1, 0, 1, 2, 2, 0, 1], dtype=np.int64),
            target_names=["/docker/a", "b\\%s", "ünï"],
            power=specials,
            metadata={
                "scope": Column(np.zeros(8, dtype=np.int64), ["cpu"]),
                "socket": Column(np.array([0, 1] * 4, dtype=np.int64), ["0", "1"]),
                "ratio": specials[::-1].copy(),
            },
        )
    )
    for written in outputs:
        one_by_one = b"".join(powerapi.encode_json(r).encode() + b"\n" for r in written.reports())
        assert encode_json_lines([written]) == one_by_one
        assert encode_json_lines(written.reports()) == one_by_one
    assert orjson.loads(encode_json_lines([outputs[-1]]).splitlines()[5])["power"] is None
    empty = HWPCFrame([], [], 0)
    assert len(empty) == 0


def test_smartwatts_estimates_a_batch_that_was_not_plain_as_the_frames_around_it(
    tmp_path: Path,
) -> None:
    """A batch with a line the JSON decoder cannot make a frame of comes as reports; SmartWatts
    makes them a frame itself, and the estimates are those of the same lines given as reports
    throughout, the odd line's metadata carried to its PowerReports."""
    lines = stream(tmp_path, ticks=40, containers=6)
    lines = _change(lines, 75, lambda d: d.update(metadata={"origin": "relay"}))
    config = SmartWattsConfig(learn_min_samples_required=5)
    SmartWattsFormula.prepare(config)

    def run(batches: list[list[Any]]) -> dict[str, list[Any]]:
        """Each kind's reports (the order between kinds is the outputs' own)."""
        formula = SmartWattsFormula(config, "node-1")
        produced: dict[str, list[Any]] = {}
        for batch in [*batches, None]:
            out = Output()
            if batch is None:
                formula.flush(out)
            else:
                formula.process(batch, out)
            assert out.rejected == []
            for report in expand(out.items()):
                produced.setdefault(report.kind, []).append(report.model_dump())
        return produced

    layouts: dict[str, Layout] = {}
    framed: list[list[Any]] = []
    for start in range(0, len(lines), 50):
        frames = decode_hwpc_frames(lines[start : start + 50], layouts)
        framed += (
            [[frame] for frame in frames] if frames else [one_by_one(lines[start : start + 50])]
        )
    assert any(isinstance(batch[0], HWPCReport) for batch in framed), "one batch was not plain"
    by_reports = [one_by_one(lines[start : start + 50]) for start in range(0, len(lines), 50)]
    produced = run(framed)
    assert produced == run(by_reports)
    assert len(produced["PowerReport"]) > 200
    relayed = [r for r in produced["PowerReport"] if r["metadata"].get("origin") == "relay"]
    assert len(relayed) >= 2, "the odd report's estimates keep its metadata"
