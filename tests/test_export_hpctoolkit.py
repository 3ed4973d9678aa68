"""The ``hpctoolkit`` exporter, read back with a reader built from the spec's layout alone.

The reader below takes every offset and field width from the spec's tables
(``specs/003_*.txt``) and reads fields one by one at those offsets, sharing nothing with the
writer: a writer that packed a field at the wrong offset, in the wrong byte order or with the
wrong width would not read back.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest

from wattflow.actors.exporters import exporters
from wattflow.formats.hpctoolkit import write_run
from wattflow.formats.reports import EventName, EventReport, PowerReport, Report
from wattflow.formats.runs import ReportLists, Run, power_pages, summarise

START = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)
DOCKER = "/system.slice/docker-abc.scope"
PID = "pid:123"
PHASES = [(2.0, 8.0, "train"), (3.0, 5.0, "epoch"), (6.0, 7.5, "epoch")]
CHAIN_SECONDS = {(): 4.0, ("train",): 2.5, ("train", "epoch"): 3.5}
"""Time with exactly each chain open in the 10 s window, worked out by hand from PHASES."""
PLACES = {DOCKER: ("container: docker-abc.scope", "process: <all processes>"),
          PID: ("container: <no container>", "process: 123")}  # fmt: skip
DOMAINS = ("cpu", "dram", "gpu", "node")


def at(seconds: float) -> datetime:
    return START + timedelta(seconds=seconds)


def ns(seconds: float) -> int:
    return 1_780_300_800_000_000_000 + round(seconds * 1e9)


# -- the reader: offsets and widths from the spec's tables ------------------------------------


def u16(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 2], "big")


def u32(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 4], "big")


def u64(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 8], "big")


def f64(data: bytes, at: int) -> float:
    value: float = struct.unpack(">d", data[at : at + 8])[0]
    return value


def read_header(data: bytes, magic: bytes, footer: bytes) -> tuple[int, int, list[int]]:
    """(count, num_sec, section fields): checks magic, version 4.0, padding and footer."""
    assert data[0:16] == magic
    assert (data[16], data[17]) == (4, 0)
    assert data[-8:] == footer
    num_sec = u16(data, 22)
    fields = [u64(data, 24 + 8 * k) for k in range(2 * num_sec)]
    assert set(data[24 + 16 * num_sec : 128]) <= {0}, "header padding is not zeros"
    assert fields[1] == 128, "the first section starts at offset 128"
    return u32(data, 18), num_sec, fields


@dataclass
class ProfileDb:
    tuples: list[tuple[tuple[int, int, int], ...]]
    values: list[dict[int, dict[int, float]]]


def read_profile_db(data: bytes) -> ProfileDb:
    num_prof, num_sec, (pi_size, pi_ptr, idt_size, idt_ptr) = read_header(
        data, b"HPCPROF-profdb__", b"tfBDFORP"
    )
    assert num_sec == 2
    assert pi_size == 52 * num_prof
    tuples: list[tuple[tuple[int, int, int], ...]] = []
    values: list[dict[int, dict[int, float]]] = []
    covered = 128 + pi_size + idt_size + 8
    for index in range(num_prof):
        info = pi_ptr + 52 * index
        tuple_at = u64(data, info)
        assert idt_ptr <= tuple_at < idt_ptr + idt_size
        assert (u64(data, info + 8), u64(data, info + 16), u64(data, info + 24)) == (0, 0, 0)
        num_vals, num_nzctxs, prof_off = (
            u64(data, info + 32),
            u32(data, info + 40),
            u64(data, info + 44),
        )
        length = u16(data, tuple_at)
        tuples.append(tuple(
            (u16(data, e), u64(data, e + 2), u64(data, e + 10))
            for e in range(tuple_at + 2, tuple_at + 2 + 18 * length, 18)
        ))  # fmt: skip
        pairs_end = prof_off + 10 * num_vals
        contexts = [
            (u32(data, p), u64(data, p + 4))
            for p in range(pairs_end, pairs_end + 12 * (num_nzctxs + 1), 12)
        ]
        assert contexts[-1] == (0x656E6421, num_vals), "end marker and end index"
        ids = [c for c, _ in contexts[:-1]]
        assert ids == sorted(set(ids)), "context ids ascend, for binary search"
        table: dict[int, dict[int, float]] = {}
        for (context, first), (_, after) in itertools.pairwise(contexts):
            assert after > first, "a listed context has a non-zero value"
            table[context] = {
                u16(data, prof_off + 10 * k + 8): f64(data, prof_off + 10 * k)
                for k in range(first, after)
            }
            assert len(table[context]) == after - first
        values.append(table)
        covered += num_vals * 10 + (num_nzctxs + 1) * 12
    assert covered == len(data), "header, sections, blocks and footer tile the file"
    return ProfileDb(tuples, values)


def read_cct_db(data: bytes) -> list[dict[int, dict[int, float]]]:
    """Per context id: metric id → prof_info_idx → value."""
    num_ctx, num_sec, (ci_size, ci_ptr) = read_header(data, b"HPCPROF-cctdb___", b"rtfBDTCC")
    assert num_sec == 1
    assert ci_size == 22 * num_ctx
    found: list[dict[int, dict[int, float]]] = []
    covered = 128 + ci_size + 8
    for context in range(num_ctx):
        info = ci_ptr + 22 * context
        assert u32(data, info) == context
        num_vals, num_nzmids, ctx_off = (
            u64(data, info + 4),
            u16(data, info + 12),
            u64(data, info + 14),
        )
        pairs_end = ctx_off + 12 * num_vals
        metrics = [
            (u16(data, p), u64(data, p + 2))
            for p in range(pairs_end, pairs_end + 10 * (num_nzmids + 1), 10)
        ]
        assert metrics[-1] == (0x6564, num_vals)
        mids = [m for m, _ in metrics[:-1]]
        assert mids == sorted(set(mids))
        table: dict[int, dict[int, float]] = {}
        for (metric, first), (_, after) in itertools.pairwise(metrics):
            table[metric] = {
                u32(data, ctx_off + 12 * k + 8): f64(data, ctx_off + 12 * k)
                for k in range(first, after)
            }
        found.append(table)
        covered += num_vals * 12 + (num_nzmids + 1) * 10
    assert covered == len(data)
    return found


def read_trace_db(data: bytes) -> dict[int, list[tuple[int, int]]]:
    """prof_info_idx → [(timestamp ns, context id)]."""
    num_traces, num_sec, (hdr_size, hdr_ptr) = read_header(data, b"HPCPROF-tracedb_", b"tfBDCART")
    assert num_sec == 1
    assert hdr_size == 22 * num_traces
    lines: dict[int, list[tuple[int, int]]] = {}
    covered = 128 + hdr_size + 8
    for index in range(num_traces):
        header = hdr_ptr + 22 * index
        profile, kind = u32(data, header), u16(data, header + 4)
        line_ptr, line_end = u64(data, header + 6), u64(data, header + 14)
        assert kind == 0
        assert (line_end - line_ptr) % 12 == 0
        lines[profile] = [(u64(data, s), u32(data, s + 8)) for s in range(line_ptr, line_end, 12)]
        covered += line_end - line_ptr
    assert covered == len(data)
    return lines


@dataclass
class Experiment:
    root: ET.Element
    paths: dict[int, tuple[str, ...]]
    """Context id (``it``) → names from the node down, via the ProcedureTable."""
    metrics: dict[tuple[str, str, str], int]
    """(domain, quantity, "I" or "E") → metric id, from the MetricTable's names."""


def read_experiment(path: Path) -> Experiment:
    root = ET.parse(path).getroot()
    assert root.tag == "HPCToolkitExperiment"
    assert root.get("version") == "4.0"
    procedures = {p.get("i"): p.get("n") for p in root.iter("Procedure")}
    paths: dict[int, tuple[str, ...]] = {}

    def walk(element: ET.Element, above: tuple[str, ...]) -> None:
        for frame in element.findall("PF"):
            name = procedures[frame.get("n")]
            assert name is not None
            assert frame.get("i") == frame.get("it")
            paths[int(frame.get("it", "-1"))] = (*above, name)
            walk(frame, (*above, name))

    data = root.find("SecCallPathProfile/SecCallPathProfileData")
    assert data is not None
    walk(data, ())
    metrics: dict[tuple[str, str, str], int] = {}
    by_id = {m.get("i"): m for m in root.iter("Metric")}
    for metric in by_id.values():
        domain, quantity, unit, scope = metric.get("n", "").split()
        assert unit == ("(J)" if quantity == "energy" else "(W)")
        assert metric.get("t") == ("inclusive" if scope == "(I)" else "exclusive")
        partner = by_id[metric.get("partner")]
        assert partner.get("n", "").split()[:2] == [domain, quantity]
        assert partner is not metric
        metrics[(domain, quantity, scope[1])] = int(metric.get("i", "-1"))
    db_ids = {(m.get("i"), m.get("n")) for m in root.iter("MetricDB")}
    assert db_ids == {(m.get("i"), m.get("n")) for m in by_id.values()}
    return Experiment(root, paths, metrics)


# -- the runs ---------------------------------------------------------------------------------


def power(target: str, domain: str, t: float) -> float:
    if domain == "gpu":
        return 100.0 + 10.0 * (t % 3)
    if target == PID:
        return 5.0
    return 10.0 + t if domain == "cpu" else 2.0


SERIES = ((DOCKER, "cpu"), (DOCKER, "dram"), (PID, "cpu"), (PID, "gpu"))


def times(domain: str) -> list[float]:
    """GPU every second, the rest every half second: trace lines of different lengths."""
    step = 1.0 if domain == "gpu" else 0.5
    return [k * step for k in range(int(10 / step) + 1)]


def events() -> list[EventReport]:
    marks: list[tuple[float, EventName]] = [
        (0, "experiment_begin"), (2, "train_begin"), (3, "epoch_begin"), (5, "epoch_end"),
        (6, "epoch_begin"), (7.5, "epoch_end"), (8, "train_end"), (10, "experiment_end"),
    ]  # fmt: skip
    return [EventReport(timestamp=at(t), sensor="node1", target="all", event=e) for t, e in marks]


def make_run(run_id: str = "r1", settings: str = "250W", repetition: int = 0) -> Run:
    return Run(
        id=run_id, experiment="exp", benchmark="bench", settings=settings,
        repetition=repetition, start=at(0), end=at(10), events=events(),
    )  # fmt: skip


def reports_of(run: Run) -> list[Report]:
    found: list[tuple[datetime, int, Report]] = [
        (e.timestamp, k, e) for k, e in enumerate(run.events)
    ]
    for target, domain in SERIES:
        for t in times(domain):
            metadata: dict[str, object] = {"scope": domain, "socket": 0}
            if domain == "gpu":
                metadata = {"scope": "gpu", "device": "0"}
            report = PowerReport(
                timestamp=at(t), sensor="node1", target=target,
                power=power(target, domain, t), metadata=metadata,
            )  # fmt: skip
            found.append((report.timestamp, len(found), report))
    rapl = PowerReport(timestamp=at(0), sensor="node1", target="rapl", power=50.0,
                       metadata={"scope": "cpu", "socket": 0})  # fmt: skip
    found.append((rapl.timestamp, len(found), rapl))
    return [report for _, _, report in sorted(found, key=lambda item: item[:2])]


def chain_at(t: float) -> tuple[str, ...]:
    return tuple(name for start, end, name in PHASES if start <= t <= end)


def context_path(target: str, t: float) -> tuple[str, ...]:
    return ("node: node1", *PLACES[target], *(f"phase: {name}" for name in chain_at(t)))


def expected_energy() -> dict[tuple[str, bool, tuple[str, ...], str], float]:
    """(target, is GPU, context path, domain) → exclusive energy: the integral, by hand."""
    found: dict[tuple[str, bool, tuple[str, ...], str], float] = {}
    for target, domain in SERIES:
        moments = times(domain)
        for before, now in itertools.pairwise(moments):
            key = (target, domain == "gpu", context_path(target, now), domain)
            found[key] = found.get(key, 0.0) + power(target, domain, now) * (now - before)
    return found


TUPLES = {
    (DOCKER, False): ((1, zlib.crc32(b"node1"), 0), (3, zlib.crc32(DOCKER.encode()), 0)),
    (PID, False): ((1, zlib.crc32(b"node1"), 0), (2, 123, 0)),
    (PID, True): ((1, zlib.crc32(b"node1"), 0), (2, 123, 0), (4, 0, 0)),
}


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = make_run()
    out = tmp_path_factory.mktemp("hpctoolkit") / "db"
    read: list[int] = []
    exporter = exporters.get("hpctoolkit")()
    assert exporter.writes_directory
    exporter.export([run], ReportLists(reports_of), out, read.append)
    assert sum(read) == len(reports_of(run))
    return out


# -- the tests --------------------------------------------------------------------------------


def test_a_single_run_is_one_database_directory(database: Path) -> None:
    assert sorted(p.name for p in database.iterdir()) == [
        "cct.db", "experiment.xml", "profile.db", "trace.db",
    ]  # fmt: skip


def test_experiment_xml_names_kinds_metrics_and_the_tree(database: Path) -> None:
    experiment = read_experiment(database / "experiment.xml")
    names = {i.get("i"): i.get("n") for i in experiment.root.iter("Identifier")}
    spec_names = ["Node", "Rank", "Thread", "GPU Device", "GPU Context", "GPU Stream", "Core"]
    assert [names[str(kind)] for kind in range(1, 8)] == spec_names
    assert {(d, q, s) for d in DOMAINS for q in ("energy", "power") for s in "IE"} == set(
        experiment.metrics
    )
    tree = set(experiment.paths.values())
    chains = {(), ("phase: train",), ("phase: train", "phase: epoch")}
    expected = (
        {("node: node1",)}
        | {("node: node1", *PLACES[target][: depth + 1]) for target in PLACES for depth in (0, 1)}
        | {
            ("node: node1", *PLACES[target], *chain)
            for target in PLACES
            for chain in chains
            if chain
        }
    )
    expected |= {path[:k] for path in expected for k in range(1, len(path))}
    assert tree == expected
    assert sorted(experiment.paths) == list(range(1, len(tree) + 1)), "ids dense; 0 is the root"
    trace_db = experiment.root.find(".//TraceDBTable/TraceDB")
    assert trace_db is not None
    assert trace_db.get("i") == "0"
    assert (trace_db.get("db-min-time"), trace_db.get("db-max-time")) == (str(ns(0)), str(ns(10)))


def test_profile_db_holds_energy_and_mean_power_per_profile_and_context(database: Path) -> None:
    experiment = read_experiment(database / "experiment.xml")
    profiles = read_profile_db((database / "profile.db").read_bytes())
    assert profiles.tuples[0] == ((0, 0, 0),), "index 0 is the summary profile"
    assert sorted(profiles.tuples[1:]) == sorted(TUPLES.values())
    context_of = {path: it for it, path in experiment.paths.items()}
    energy = expected_energy()
    expected: list[dict[int, dict[int, float]]] = [{} for _ in profiles.tuples]

    def add(profile: int, context: int, metric: int, value: float) -> None:
        for index in (0, profile):
            table = expected[index].setdefault(context, {})
            table[metric] = table.get(metric, 0.0) + value

    for (target, gpu, path, domain), joules in energy.items():
        profile = profiles.tuples.index(TUPLES[(target, gpu)])
        add(profile, context_of[path], experiment.metrics[(domain, "energy", "E")], joules)
        for depth in range(len(path) + 1):
            context = context_of[path[:depth]] if depth else 0
            add(profile, context, experiment.metrics[(domain, "energy", "I")], joules)
    for index in range(1, len(profiles.tuples)):
        for context, table in list(expected[index].items()):
            path = experiment.paths.get(context, ())
            chain = tuple(p.removeprefix("phase: ") for p in path[3:])
            inclusive = sum(s for c, s in CHAIN_SECONDS.items() if c[: len(chain)] == chain)
            spans = {"I": inclusive if len(path) >= 3 else 10.0,
                     "E": CHAIN_SECONDS[chain] if len(path) >= 3 else 0.0}  # fmt: skip
            for domain in DOMAINS:
                for scope, seconds in spans.items():
                    joules = table.get(experiment.metrics[(domain, "energy", scope)], 0.0)
                    if joules:
                        metric = experiment.metrics[(domain, "power", scope)]
                        add(index, context, metric, joules / seconds)
    assert [set(t) for t in profiles.values] == [set(t) for t in expected]
    for got, want in zip(profiles.values, expected, strict=True):
        for context, table in want.items():
            assert got[context] == pytest.approx(table, rel=1e-12), context
    # The whole-run energy per target agrees with summarise, which every exporter shares.
    summary = summarise(make_run(), reports_of(make_run()))
    root = profiles.values[0][0]
    for domain in ("cpu", "dram", "gpu"):
        total = sum(summary.energy(target, domain) for target in summary.targets())
        assert root[experiment.metrics[(domain, "energy", "I")]] == pytest.approx(total)
    assert root[experiment.metrics[("cpu", "energy", "I")]] > 0


def test_cct_db_holds_the_same_values_by_context(database: Path) -> None:
    profiles = read_profile_db((database / "profile.db").read_bytes())
    by_context = read_cct_db((database / "cct.db").read_bytes())
    transposed: dict[int, dict[int, dict[int, float]]] = {}
    for index, table in enumerate(profiles.values[1:], start=1):
        for context, by_metric in table.items():
            for metric, value in by_metric.items():
                transposed.setdefault(context, {}).setdefault(metric, {})[index] = value
    assert len(by_context) == len(read_experiment(database / "experiment.xml").paths) + 1
    assert {c: t for c, t in enumerate(by_context) if t} == transposed
    assert by_context[0], "the root holds every profile's inclusive values"


def test_trace_db_lines_follow_the_reports_in_order(database: Path) -> None:
    experiment = read_experiment(database / "experiment.xml")
    profiles = read_profile_db((database / "profile.db").read_bytes())
    lines = read_trace_db((database / "trace.db").read_bytes())
    context_of = {path: it for it, path in experiment.paths.items()}
    assert sorted(lines) == list(range(1, len(profiles.tuples))), "one line per real profile"
    for (target, gpu), identifier in TUPLES.items():
        domain = "gpu" if gpu else "cpu"
        want = [(ns(t), context_of[context_path(target, t)]) for t in times(domain)]
        assert lines[profiles.tuples.index(identifier)] == want


def test_spilled_trace_lines_read_back_the_same(tmp_path: Path) -> None:
    run = make_run()
    write_run(run, power_pages(reports_of(run)), tmp_path / "held")
    write_run(run, power_pages(reports_of(run)), tmp_path / "spilled", spool_bytes=24)
    for name in ("trace.db", "profile.db", "cct.db", "experiment.xml"):
        assert (tmp_path / "held" / name).read_bytes() == (tmp_path / "spilled" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "spilled").iterdir())[0] == "cct.db"
    assert len(list((tmp_path / "spilled").iterdir())) == 4, "the spool is removed"


def test_several_runs_get_one_sanitised_directory_each(tmp_path: Path) -> None:
    runs = [make_run("a", "250W/x", 0), make_run("b", "250W/x", 1), make_run("c", "..", 0)]
    stream: dict[str, list[Report]] = {run.id: reports_of(run) for run in runs}
    read: list[int] = []

    def reports(run: Run) -> Iterator[Report]:
        return iter(stream[run.id])

    exporters.get("hpctoolkit")().export(runs, ReportLists(reports), tmp_path / "out", read.append)
    assert sum(read) == sum(len(s) for s in stream.values())
    for run, settings in zip(runs, ("250W_x", "250W_x", "__"), strict=True):
        directory = tmp_path / "out" / "exp" / "bench" / settings / str(run.repetition)
        lines = read_trace_db((directory / "trace.db").read_bytes())
        assert sum(len(line) for line in lines.values()) == 21 + 21 + 11
        header = ET.parse(directory / "experiment.xml").getroot().find("Header")
        assert header is not None
        assert header.get("n") == f"exp/bench/{run.settings}/{run.repetition}"


def test_a_run_without_power_is_an_empty_database(tmp_path: Path) -> None:
    run = make_run()
    write_run(run, power_pages(run.events), tmp_path)
    profiles = read_profile_db((tmp_path / "profile.db").read_bytes())
    assert profiles.tuples == [((0, 0, 0),)]
    assert profiles.values == [{}]
    assert read_cct_db((tmp_path / "cct.db").read_bytes()) == [{}]
    assert read_trace_db((tmp_path / "trace.db").read_bytes()) == {}
    trace_db = ET.parse(tmp_path / "experiment.xml").getroot().find(".//TraceDB")
    assert trace_db is not None
    assert (trace_db.get("db-min-time"), trace_db.get("db-max-time")) == (str(ns(0)), str(ns(10)))


def test_late_samples_are_dropped_and_zero_energy_is_not_listed(tmp_path: Path) -> None:
    run = make_run()
    late = [
        PowerReport(timestamp=at(t), sensor="node1", target=PID, power=5.0,
                    metadata={"scope": "cpu"})
        for t in (1.0, 4.0, 3.0, 4.0, 9.0)
    ]  # fmt: skip
    idle = [
        PowerReport(timestamp=at(t), sensor="node1", target="idle", power=0.0,
                    metadata={"scope": "cpu"})
        for t in (9.5, 10.0)
    ]  # fmt: skip
    write_run(run, power_pages(late + idle), tmp_path)
    profiles = read_profile_db((tmp_path / "profile.db").read_bytes())
    assert profiles.values[2] == {}, "a profile without energy lists no context"
    experiment = read_experiment(tmp_path / "experiment.xml")
    context_of = {path: it for it, path in experiment.paths.items()}
    lines = read_trace_db((tmp_path / "trace.db").read_bytes())
    assert len(lines[2]) == 2
    assert lines[1] == [(ns(t), context_of[context_path(PID, t)]) for t in (1.0, 4.0, 9.0)]
