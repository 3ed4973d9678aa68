"""The C parser of hwpc-sensor's JSON lines against the Python way, on generated and mutated
batches.

``compiled_hwpc_frames`` may decline any batch (the Python way then decides), but a frame it
makes must be the frame the Python way makes of the same batch: same names, same columns, same
reports, and the same layouts remembered; and either way's frames are canonical, as the decoder
promises (``HWPCFrame.canonical``: SmartWatts then skips its check). Batches are slices of
generated hwpc-sensor streams, with mutations of every kind a line can carry (other key orders
and spaces, escapes, floats, huge and negative integers, sockets and cpus at and beyond their
bounds, missing, extra and reordered events, repeated keys and targets, timestamps going back,
truncated lines, random bytes) and random bytes alone: the socket input is a network input, so
the parser is also run on what no sensor writes.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from wattflow.formats import json_frames
from wattflow.formats.json_frames import Layout, compiled_hwpc_frames

from .parser_oracle import agree, python_way

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generate_hwpc import record


@cache
def generated(multiplex: float) -> list[bytes]:
    """Two sensors' streams, interleaved by tick, as a shared file holds them."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hwpc.jsonl"
        record(jsonl=path, ticks=4, containers=3, sensors=("node-1", "node-2"), multiplex=multiplex)
        return path.read_bytes().splitlines()


def test_the_c_parser_is_built() -> None:
    """The tests below compare it with the Python way: it must be there to compare."""
    assert json_frames.c_parser_built()


def test_generated_batches_are_framed_the_same_way() -> None:
    """Cut anywhere, batch after batch with what the input remembers: the same frames, and
    only the batches the Python way cuts in two (a tick's reports after a group it did not
    know) are left to it."""
    for multiplex in (0.0, 0.3):
        lines = generated(multiplex)
        for size in (1, 3, 10, 17, 100, len(lines)):
            layouts: dict[str, Layout] = {}
            made = 0
            for start in range(0, len(lines), size):
                batch = lines[start : start + size]
                if agree(batch, layouts):
                    made += 1
                python_way(batch, layouts)  # the layouts the input keeps, learned either way
            assert made >= (len(lines) + size - 1) // size - 1, "only a first batch may need a cut"


# --- mutations ----------------------------------------------------------------------------------


def _document(line: bytes) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(line)
    return document


def _cpus(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        counters
        for sockets in document["groups"].values()
        for cpus in sockets.values()
        for counters in cpus.values()
    ]


def _on_document(change: Callable[[dict[str, Any], random.Random], None]) -> Callable[..., Any]:
    def mutate(line: bytes, rng: random.Random) -> bytes:
        document = _document(line)
        change(document, rng)
        return json.dumps(document, separators=(",", ":")).encode()

    return mutate


def _on_cpu(change: Callable[[dict[str, Any], random.Random], None]) -> Callable[..., Any]:
    return _on_document(lambda document, rng: change(rng.choice(_cpus(document)), rng))


def _set_counter(value: Any) -> Callable[..., Any]:
    def change(counters: dict[str, Any], rng: random.Random) -> None:
        counters[rng.choice(list(counters))] = value

    return _on_cpu(change)


def _drop_last(counters: dict[str, Any]) -> None:
    counters.popitem()


def _reorder_keys(document: dict[str, Any], rng: random.Random) -> None:
    items = list(document.items())
    rng.shuffle(items)
    document.clear()
    document.update(items)


def _reorder_events(counters: dict[str, Any], rng: random.Random) -> None:
    items = list(counters.items())
    rng.shuffle(items)
    counters.clear()
    counters.update(items)


def _each_cpu(
    document: dict[str, Any], change: Callable[[dict[str, Any], random.Random], None]
) -> None:
    """The same change on every cpu (the same shuffle, from the same seed)."""
    for counters in _cpus(document):
        change(counters, random.Random(1))


def _rename_first_key(level: str) -> Callable[..., Any]:
    """A socket or cpu key written another way than its number."""

    def change(document: dict[str, Any], rng: random.Random) -> None:
        sockets = rng.choice(list(document["groups"].values()))
        if level == "socket":
            key = next(iter(sockets))
            sockets[rng.choice(["0" + key, "-" + key, " " + key, key + ".0", "+" + key])] = (
                sockets.pop(key)
            )
        else:
            cpus = next(iter(sockets.values()))
            key = next(iter(cpus))
            cpus[rng.choice(["0" + key, "-1", "1e0", "9" * 30])] = cpus.pop(key)

    return _on_document(change)


def _renumber_first_key(level: str, number: int) -> Callable[..., Any]:
    """A socket or cpu given another number: at the bounds (65,536 sockets, 1,048,576 cpus)
    and far beyond them."""

    def change(document: dict[str, Any], rng: random.Random) -> None:
        sockets = rng.choice(list(document["groups"].values()))
        if level == "socket":
            sockets[str(number)] = sockets.pop(next(iter(sockets)))
        else:
            cpus = next(iter(sockets.values()))
            cpus[str(number)] = cpus.pop(next(iter(cpus)))

    return _on_document(change)


def _spaces(line: bytes, rng: random.Random) -> bytes:
    indent = rng.choice([None, 1, "\t"])
    separators = rng.choice([(", ", ": "), (",", ":"), (" ,", " :")])
    text = json.dumps(_document(line), indent=indent, separators=separators)
    spaced = rng.choice(["", " ", "\r", "\t"]) + text + rng.choice(["", " ", "\r\n", "\n", "\x0c"])
    return spaced.encode()


def _escape(line: bytes, rng: random.Random) -> bytes:
    at = line.index(rng.choice([b'"target":"', b'"sensor":"', b'"groups":{"'])) + 10
    return line[:at] + b"\\u0061" + line[at:]


def _repeat_key(line: bytes, rng: random.Random) -> bytes:
    """A JSON object with a key twice, written as text (json.dumps cannot)."""
    document = _document(line)
    which = rng.choice(["top", "group", "socket", "cpu", "event"])
    text = json.dumps(document, separators=(",", ":"))
    if which == "top":
        return (text[:-1] + ',"target":"x"}').encode()
    group = next(iter(document["groups"]))
    sockets = document["groups"][group]
    socket = next(iter(sockets))
    cpu = next(iter(sockets[socket]))
    event = next(iter(sockets[socket][cpu]))
    if which == "group":
        extra = f'"{group}":{json.dumps(sockets, separators=(",", ":"))},'
        return text.replace('"groups":{', '"groups":{' + extra, 1).encode()
    if which == "socket":
        extra = f'"{socket}":{json.dumps(sockets[socket], separators=(",", ":"))},'
        return text.replace(f'"{group}":{{', f'"{group}":{{' + extra, 1).encode()
    if which == "cpu":
        counters = json.dumps(sockets[socket][cpu], separators=(",", ":"))
        inner = f'"{socket}":{{"{cpu}":'
        return text.replace(inner, inner + counters + f',"{cpu}":', 1).encode()
    inner = f'"{cpu}":{{"{event}":'
    return text.replace(inner, inner + f'7,"{event}":', 1).encode()


def _truncate(line: bytes, rng: random.Random) -> bytes:
    return line[: rng.randrange(len(line))]


def _random_bytes(line: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(line))
    noise = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
    return line[:at] + noise + line[at + rng.randrange(0, 3) :]


def _flip_digit(line: bytes, rng: random.Random) -> bytes:
    """A counter changed in its text: another number, or a sign, a point, a leading zero."""
    digits = [at for at, byte in enumerate(line) if 0x30 <= byte <= 0x39]
    at = rng.choice(digits)
    return line[:at] + rng.choice([b"-", b".5", b"0", b"e1", b"9" * 25, b"1"]) + line[at:]


MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "reordered keys": _on_document(_reorder_keys),
    "reordered groups": _on_document(lambda document, rng: _reorder_keys(document["groups"], rng)),
    "spaces": _spaces,
    "an escape": _escape,
    "a float counter": _set_counter(1.5),
    "a whole float counter": _set_counter(2.0),
    "a huge counter": _set_counter(2**64 + 1),
    "a counter of 2**63": _set_counter(2**63),
    "the largest counter": _set_counter(2**63 - 1),
    "a negative counter": _set_counter(-3),
    "a boolean counter": _set_counter(True),
    "a null counter": _set_counter(None),
    "a text counter": _set_counter("12"),
    "a missing event": _on_cpu(lambda counters, rng: _drop_last(counters)),
    "an extra event": _on_cpu(lambda counters, rng: counters.update(EXTRA=1)),
    "reordered events": _on_cpu(_reorder_events),
    "every cpu's events reordered": _on_document(
        lambda document, rng: _each_cpu(document, _reorder_events)
    ),
    "a cpu without events": _on_cpu(lambda counters, rng: counters.clear()),
    "a socket written another way": _rename_first_key("socket"),
    "a cpu written another way": _rename_first_key("cpu"),
    "the largest socket": _renumber_first_key("socket", 65_535),
    "a socket of 65536": _renumber_first_key("socket", 65_536),
    "a socket of 2**63": _renumber_first_key("socket", 2**63),
    "a socket of 10**18": _renumber_first_key("socket", 10**18),
    "the largest cpu": _renumber_first_key("cpu", 1_048_575),
    "a cpu of 1048576": _renumber_first_key("cpu", 1_048_576),
    "a cpu of 2**63": _renumber_first_key("cpu", 2**63),
    "a cpu of 10**18": _renumber_first_key("cpu", 10**18),
    "metadata": _on_document(lambda document, rng: document.update(metadata={"k": 1})),
    "empty metadata": _on_document(lambda document, rng: document.update(metadata={})),
    "an unknown key": _on_document(lambda document, rng: document.update(extra=[1])),
    "no groups": _on_document(lambda document, rng: document.update(groups={})),
    "an empty group": _on_document(lambda document, rng: document["groups"].update({"core": {}})),
    "a timestamp in milliseconds": _on_document(
        lambda document, rng: document.update(timestamp=1_767_603_600_000)
    ),
    "a finer timestamp": _on_document(
        lambda document, rng: document.update(timestamp=document["timestamp"] + "5")
    ),
    "a float timestamp": _on_document(lambda document, rng: document.update(timestamp=1.5e12)),
    "an empty target": _on_document(lambda document, rng: document.update(target="")),
    "a target of another alphabet": _on_document(
        lambda document, rng: document.update(target="ünï-" + document["target"])
    ),
    "a repeated key": _repeat_key,
    "a truncated line": _truncate,
    "random bytes": _random_bytes,
    "a changed digit": _flip_digit,
    "bytes not UTF-8 in a name": lambda line, rng: line.replace(b'"target":"', b'"target":"\xff'),
}
"""Each takes a line (bytes) and gives it changed."""

BATCH_CHANGES: dict[str, Callable[[list[Any], int, random.Random], list[Any]]] = {
    "a line twice": lambda lines, at, rng: [*lines[: at + 1], lines[at], *lines[at + 1 :]],
    "two lines swapped": lambda lines, at, rng: [
        *lines[:at],
        *lines[at : at + 2][::-1],
        *lines[at + 2 :],
    ],
    "a line moved back": lambda lines, at, rng: [lines[at], *lines[:at], *lines[at + 1 :]],
    "a blank line": lambda lines, at, rng: [*lines[:at], b" \t", *lines[at:]],
    "a text line": lambda lines, at, rng: [*lines[:at], lines[at].decode(), *lines[at + 1 :]],
    "a line dropped": lambda lines, at, rng: [*lines[:at], *lines[at + 1 :]],
}


@settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    multiplex=st.sampled_from([0.0, 0.3]),
    start=st.integers(0, 60),
    size=st.integers(1, 40),
    learned=st.booleans(),
    changes=st.lists(
        st.tuples(
            st.sampled_from(sorted(MUTATIONS) + sorted(BATCH_CHANGES)),
            st.integers(0, 10**6),
            st.integers(0, 2**32),
        ),
        max_size=3,
    ),
)
def test_mutated_batches_are_framed_the_same_way_or_declined(
    multiplex: float,
    start: int,
    size: int,
    learned: bool,
    changes: list[tuple[str, int, int]],
) -> None:
    lines = generated(multiplex)
    start %= len(lines)
    layouts: dict[str, Layout] = {}
    if learned:  # what the input remembers from the lines before
        python_way(lines[:start], layouts)
    batch: list[Any] = list(lines[start : start + size])
    assume(batch)
    for name, where, seed in changes:
        rng = random.Random(seed)
        at = where % len(batch)
        try:
            if name in MUTATIONS:
                batch[at] = MUTATIONS[name](batch[at], rng)
            else:
                batch = BATCH_CHANGES[name](batch, at, rng) or batch
        except (ValueError, LookupError, TypeError, AttributeError, StopIteration):
            pass  # a mutation that needs what an earlier one broke (JSON, an event) is skipped
    event("framed" if agree(batch, layouts) else "declined")


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
def test_random_bytes_are_declined(lines: list[bytes]) -> None:
    assert compiled_hwpc_frames(lines) is None or agree(lines)


@settings(max_examples=200, deadline=None, database=None)
@given(prefix=st.integers(0, 3000), line=st.integers(0, 30))
def test_every_prefix_of_a_line_is_read_within_its_bounds(prefix: int, line: int) -> None:
    """A line cut anywhere (the parser must stop at its end, not read past it)."""
    whole = generated(0.0)[line]
    cut = bytes(whole[: prefix % (len(whole) + 1)])  # a copy: nothing valid lies beyond it
    agree([cut])


def test_what_the_c_parser_declines() -> None:
    """Plain lines it leaves to the Python way, which makes frames of them: declining is
    always safe, and these are rarer than hwpc-sensor's own form."""
    first = generated(0.0)[0]
    escaped = first.replace(b'"target":"all"', b'"target":"\\u0061ll"')
    assert python_way([escaped], {}) is not None
    assert compiled_hwpc_frames([escaped]) is None
    assert compiled_hwpc_frames([first]) is not None


@pytest.mark.parametrize(
    ("level", "number", "framed"),
    [
        ("socket", 65_535, True),
        ("socket", 65_536, False),
        ("socket", 10**18, False),
        ("socket", 2**63, False),
        ("cpu", 1_048_575, True),
        ("cpu", 1_048_576, False),
        ("cpu", 10**18, False),
        ("cpu", 2**63, False),
    ],
)
def test_sockets_and_cpus_beyond_their_bounds_are_declined_both_ways(
    level: str, number: int, framed: bool
) -> None:
    """The largest socket (65,535) and cpu (1,048,575) numbers are framed, the same way by
    both; one more, or far more, and neither way makes a frame: the line-by-line way then
    refuses that report alone."""
    lines = generated(0.0)[8:24]
    for at in (0, 5):
        batch = list(lines)
        batch[at] = _renumber_first_key(level, number)(batch[at], random.Random(at))
        assert str(number).encode() in batch[at]
        assert agree(batch) is framed
        assert (python_way(batch, {}) is not None) is framed


def fresh_and_remembered_layouts(before: list[Any]) -> list[dict[str, Layout]]:
    """No layouts, then the layouts an input remembers after the ``before`` lines."""
    remembered: dict[str, Layout] = {}
    python_way(before, remembered)
    return [{}, remembered]


def test_every_line_out_of_place_is_framed_the_same_way_or_declined() -> None:
    """Each batch change at each line of two sensors' first ticks (a line twice, lines
    swapped, a line moved to the front, dropped, a blank line), with and without the layouts
    the input remembers: ticks going back, a target twice in a tick and a tick's reports in
    another group order are each met somewhere."""
    lines = generated(0.0)
    batch = lines[8:32]
    for layouts in fresh_and_remembered_layouts(lines[:8]):
        for change in BATCH_CHANGES.values():
            for at in range(len(batch) - 1):
                agree(change(list(batch), at, random.Random(at)), layouts)


def test_every_mutation_of_every_line_is_framed_the_same_way_or_declined() -> None:
    """Each mutation at each line of a batch (the global reports and the containers'), with
    and without the layouts the input remembers."""
    lines = generated(0.0)
    batch = lines[8:24]
    for layouts in fresh_and_remembered_layouts(lines[:8]):
        for mutate in MUTATIONS.values():
            for at in range(len(batch)):
                changed = list(batch)
                try:
                    changed[at] = mutate(changed[at], random.Random(at))
                except (ValueError, LookupError):
                    continue  # a mutation that needs what the line lacks (an event to drop)
                agree(changed, layouts)
