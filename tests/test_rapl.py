"""The RAPL formula on PowerAPI's recordings and on edge cases of real counters."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from wattflow.actors.formulas.base import Output
from wattflow.actors.formulas.rapl import RAPL_UNIT_J, RaplConfig, RaplFormula
from wattflow.formats import jsonl, powerapi
from wattflow.formats.batch import expand
from wattflow.formats.frames import HWPCFrame
from wattflow.formats.reports import HWPCReport, PowerReport, Report, to_utc


def run_formula(reports: list[Report], config: RaplConfig | None = None) -> Output:
    instances: dict[object, RaplFormula] = {}
    out = Output()
    for report in reports:
        key = RaplFormula.dispatch_key(report)
        if key is None:
            continue
        formula = instances.setdefault(key, RaplFormula(config or RaplConfig(), key))
        formula.process([report], out)
    out.reports, out.frames = expand(out.items()), []
    return out


def powers(out: Output) -> dict[tuple[str, str, str], float]:
    result = {}
    for report in out.reports:
        assert isinstance(report, PowerReport)
        assert report.target == "rapl"
        key = (str(report.timestamp), report.metadata["socket"], report.metadata["scope"])
        result[key] = report.power
    return result


def test_rapl2_fixture_gives_the_documented_powers(fixtures: Path) -> None:
    reports: list[Report] = [
        r
        for r in powerapi.read_hwpc_csv([fixtures / "csv" / "rapl2.csv"])
        if isinstance(r, HWPCReport)
    ]
    out = run_formula(reports)
    assert out.absorbed == 1, "the first tick only starts the first interval"
    second = str(to_utc(1539260665189))
    got = powers(out)
    assert set(got) == {(second, s, scope) for s in ("0", "1") for scope in ("cpu", "dram")}
    assert got[(second, "0", "cpu")] == pytest.approx(19.46, abs=0.005)
    assert got[(second, "0", "cpu")] == pytest.approx(83577274368 * RAPL_UNIT_J / 1.0)
    assert got[(second, "0", "dram")] == pytest.approx(10479468544 * RAPL_UNIT_J)
    assert got[(second, "1", "cpu")] == pytest.approx(33809760256 * RAPL_UNIT_J)
    meta = {(r.metadata["socket"], r.metadata["scope"]): r.metadata for r in out.reports}
    assert meta[("0", "cpu")] == {
        "scope": "cpu",
        "socket": "0",
        "formula": "RAPL_ENERGY_PKG",
        "ratio": 1.0,
    }
    assert meta[("1", "dram")]["formula"] == "RAPL_ENERGY_DRAM"


@pytest.mark.parametrize("global_target", ["all", "system"])
def test_both_names_of_the_global_target_are_accepted(global_target: str) -> None:
    out = run_formula([tick(0, 0, target=global_target), tick(1, 2**32, target=global_target)])
    assert [r.power for r in out.reports if isinstance(r, PowerReport)] == [1.0]


def tick(
    second: float, pkg: float, *, target: str = "all", psys: float | None = None, sensor: str = "s"
) -> HWPCReport:
    events: dict[str, int | float] = {"RAPL_ENERGY_PKG": pkg}
    if psys is not None:
        events["RAPL_ENERGY_PSYS"] = psys
    return HWPCReport(
        timestamp=to_utc(1_600_000_000_000) + timedelta(seconds=second),
        sensor=sensor,
        target=target,
        groups={"rapl": {"0": {"0": events}}},
    )


def test_power_uses_the_real_interval_between_ticks() -> None:
    out = run_formula([tick(0, 0), tick(1, 2**32), tick(3, 2**32), tick(3.5, 2**32)])
    assert [r.power for r in out.reports if isinstance(r, PowerReport)] == [1.0, 0.5, 2.0]


def test_the_global_reports_metadata_is_carried_over() -> None:
    first, second = tick(0, 0), tick(1, 2**32)
    second = second.model_copy(update={"metadata": {"k8s": {"node": "n1"}}})
    (report,) = run_formula([first, second]).reports
    assert report.metadata["k8s"] == {"node": "n1"}
    assert report.metadata["scope"] == "cpu"


def test_psys_is_reported_where_present() -> None:
    out = run_formula([tick(0, 0, psys=0), tick(1, 2**32, psys=3 * 2**32)])
    scopes = {r.metadata["scope"]: r.power for r in out.reports if isinstance(r, PowerReport)}
    assert scopes == {"cpu": 1.0, "psys": 3.0}


def test_sensors_are_independent() -> None:
    out = run_formula(
        [
            tick(0, 0, sensor="a"),
            tick(0.5, 0, sensor="b"),
            tick(1, 2**32, sensor="a"),
            tick(2.5, 2**32, sensor="b"),
        ]
    )
    by_sensor = {r.sensor: r.power for r in out.reports if isinstance(r, PowerReport)}
    assert by_sensor == {"a": 1.0, "b": 0.5}


def test_bad_ticks_are_rejected_with_a_reason() -> None:
    out = run_formula(
        [
            tick(0, 0),
            tick(1, 2**32),
            tick(0.5, 2**32),
            tick(1.01, 2**32),
            tick(2, -5),
            tick(3, 2**32),
        ]
    )
    reasons = [reason for _, reason in out.rejected]
    assert len(reasons) == 3
    assert "is not after the previous one" in reasons[0]
    assert "under a quarter of the sensor period" in reasons[1]
    assert "negative energy delta" in reasons[2]
    assert [r.power for r in out.reports if isinstance(r, PowerReport)] == [1.0, 1.0]


def test_per_target_reports_are_not_for_rapl(fixtures: Path) -> None:
    core = HWPCReport(
        timestamp=to_utc(0),
        sensor="s",
        target="web",
        groups={"core": {"0": {"0": {"INSTRUCTIONS_RETIRED": 5}}}},
    )
    assert RaplFormula.dispatch_key(core) is None
    reports = [
        r
        for r in jsonl.read_reports_document(HWPCReport, fixtures / "hwpc.json")
        if isinstance(r, HWPCReport)
    ]
    out = run_formula(list(reports))
    assert len(out.reports) == len(reports) - 1
    assert all(0 < r.power < 50 for r in out.reports if isinstance(r, PowerReport))


def test_compat_mode_divides_by_the_configured_period_from_the_first_tick(fixtures: Path) -> None:
    reports: list[Report] = [
        r
        for r in powerapi.read_hwpc_csv([fixtures / "csv" / "rapl2.csv"])
        if isinstance(r, HWPCReport)
    ]
    config = RaplConfig(compat="smartwatts-2.4", sensor_reports_frequency=500)
    out = run_formula(reports, config)
    got = powers(out)
    first = str(to_utc(1539260664189))
    second = str(to_utc(1539260665189))
    assert out.absorbed == 0
    # SmartWatts 2.4.1 reads every tick's energy as spent over the configured 0.5 s.
    assert got[(first, "0", "cpu")] == pytest.approx(722468864 * RAPL_UNIT_J / 0.5)
    assert got[(second, "0", "cpu")] == pytest.approx(83577274368 * RAPL_UNIT_J / 0.5)


def _core(second: float, *, target: str, sensor: str = "s") -> HWPCReport:
    return HWPCReport(
        timestamp=to_utc(1_600_000_000_000) + timedelta(seconds=second),
        sensor=sensor,
        target=target,
        groups={"core": {"0": {"0": {"CPU_CLK_THREAD_UNHALTED:REF_P": 5}}}},
    )


def _with_core(report: HWPCReport) -> HWPCReport:
    core = {"core": {"0": {"0": {"CPU_CLK_THREAD_UNHALTED:REF_P": 7}}}}
    return report.model_copy(update={"groups": {**report.groups, **core}})


@pytest.mark.parametrize(
    ("reports", "parts"),
    [
        pytest.param(  # every global report has RAPL energy: one part per sensor
            [_with_core(tick(0, 0)), _core(0, target="c1"), _with_core(tick(1, 9)),
             _core(1, target="c1"), tick(0, 0, sensor="t"), tick(1, 5, sensor="t")],
            {"s": 2, "t": 2}, id="parts",
        ),
        pytest.param([_core(0, target="c1"), _core(1, target="c2")], {}, id="targets-only"),
        pytest.param(  # a global report without RAPL energy: the frame goes as reports
            [_with_core(tick(0, 0)), _core(1, target="all")], None, id="global-without-rapl",
        ),
        pytest.param(  # a target's RAPL rows: the frame goes as reports
            [tick(0, 0), tick(0, 1, target="c1")], None, id="target-with-rapl",
        ),
        pytest.param([_core(0, target="all")], None, id="no-rapl-group"),
    ],
)  # fmt: skip
def test_the_routers_split_of_a_frame_takes_what_the_report_by_report_way_takes(
    reports: list[HWPCReport], parts: dict[str, int] | None
) -> None:
    """The router sends a frame's parts to the RAPL instances only when they stand for exactly
    the reports ``dispatch_key`` would send them; otherwise (``None``) the frame goes as its
    reports."""
    frame, refused = HWPCFrame.from_reports(reports)
    assert refused == []
    found = RaplFormula.frame_parts(frame)
    if parts is None:
        assert found is None
        return
    assert found is not None
    assert {key: len(part) for key, part in found} == parts
    by_key: dict[object, list[Report]] = {}
    for report in reports:
        key = RaplFormula.dispatch_key(report)
        if key is not None:
            by_key.setdefault(key, []).append(report)
    assert {key: part.reports() for key, part in found} == by_key
