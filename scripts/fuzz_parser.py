"""Coverage-guided fuzzing of the C parser (formats/_hwpc_lines.c) with atheris (libFuzzer).

    python scripts/fuzz_parser.py {json-lines,csv} [libFuzzer flags...] [inputs...]

Run it through ``scripts/test-parser`` (``FUZZ_S=SECONDS`` for a longer run), which builds the
parser with clang's libFuzzer coverage, AddressSanitizer and UndefinedBehaviorSanitizer into
build/fuzz/parser/, names that build in ``C_PARSER_BUILD`` and preloads atheris's sanitizer
runtime. Each input goes to a target of ``tests/fuzz_targets.py``, which holds the parser's answer
to the Python way's (a differential oracle), so a disagreement stops the run as a crash would.

The corpus starts from seeds written afresh into build/fuzz/seeds/TARGET/ (the recordings under
tests/data/ and service/data/, a generated stream, inputs at the parser's limits, and every input
kept under tests/data/fuzz-regressions/TARGET/) and grows in build/fuzz/corpus/TARGET/, kept
between runs. An input that fails is written to build/fuzz/crashes/TARGET/: copy it to
tests/data/fuzz-regressions/TARGET/, where tests/test_fuzz_regressions.py replays it. Given files
(or folders) instead, libFuzzer runs those files once each (or fuzzes those folders).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "fuzz"
REGRESSIONS = ROOT / "tests" / "data" / "fuzz-regressions"
SEED_BYTES = 4096
"""The largest seed, and the largest input the fuzzer makes (``-max_len``): a few lines or rows
reach every branch of the parser, and short inputs run many times a second."""
SEEDS_PER_FILE = 8
"""Seeds cut from one recording: its first kilobytes, where every kind of line already is."""


def chunks(lines: list[bytes], header: bytes = b"") -> Iterator[bytes]:
    """Consecutive lines (each after ``header``) in pieces of at most SEED_BYTES."""
    piece = header
    for line in lines:
        if len(piece) + len(line) + 1 > SEED_BYTES and piece != header:
            yield piece
            piece = header
        piece += line + b"\n"
    if piece != header:
        yield piece


def json_seeds(folder: Path) -> Iterator[bytes]:
    """hwpc-sensor's lines: the demo's recording, PowerAPI's reports written as lines (compact,
    and with json.dumps's spaces), and a generated stream of two sensors with multiplexing."""
    yield from list(chunks((ROOT / "service/data/demo-hwpc.jsonl").read_bytes().splitlines()))[
        :SEEDS_PER_FILE
    ]
    for name in ("hwpc.json", "hwpc_rapl_2_socket.json"):
        reports = json.loads((ROOT / "tests/data/powerapi-2.10.0" / name).read_text())["reports"]
        for report in reports:
            report.pop("_id", None)
        for separators in ((",", ":"), (", ", ": ")):
            lines = [json.dumps(report, separators=separators).encode() for report in reports]
            yield from list(chunks(lines))[:SEEDS_PER_FILE]
    yield from list(chunks((folder / "hwpc.jsonl").read_bytes().splitlines()))[:SEEDS_PER_FILE]


def csv_seeds(folder: Path) -> Iterator[bytes]:
    """hwpc-sensor's CSV files: PowerAPI's recordings (some of them bad), SmartWatts 2.4.1's
    inputs and a generated recording, each cut into pieces that keep its header."""
    for path in sorted((ROOT / "tests/data/powerapi-2.10.0/csv").glob("*.csv")):
        yield path.read_bytes()[:SEED_BYTES]
    for path in [
        *sorted((ROOT / "tests/data/smartwatts-2.4.1/input").glob("*.csv")),
        *sorted((folder / "csv").glob("*.csv")),
    ]:
        header, *rows = path.read_bytes().splitlines()
        yield from list(chunks(rows, header + b"\n"))[:SEEDS_PER_FILE]


def write_seeds(target: str, seeds: Path) -> int:
    """The seed corpus of ``target`` written afresh into ``seeds``; how many seeds."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from generate_hwpc import record

    from tests.fuzz_targets import csv_files_at_the_limits, json_lines_at_the_limits

    shutil.rmtree(seeds, ignore_errors=True)
    seeds.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as folder:
        generated = Path(folder)
        record(
            jsonl=generated / "hwpc.jsonl",
            csv_dir=generated / "csv",
            ticks=3,
            containers=2,
            sensors=("node-1", "node-2"),
            multiplex=0.3,
        )
        made = list(json_seeds(generated) if target == "json-lines" else csv_seeds(generated))
    made += json_lines_at_the_limits() if target == "json-lines" else csv_files_at_the_limits()
    made += [path.read_bytes() for path in sorted((REGRESSIONS / target).glob("*"))]
    for number, seed in enumerate(made):
        (seeds / f"seed-{number:03d}").write_bytes(seed)
    return len(made)


def target_of(name: str, scratch: Path) -> Callable[[bytes], None]:
    """The fuzz target called ``name``, importing the parser only now: after ``C_PARSER_BUILD``
    has put the instrumented build in place of the installed one."""
    from tests.fuzz_targets import csv_file, json_lines

    if name == "json-lines":
        return json_lines
    return lambda data: csv_file(data, scratch)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("json-lines", "csv"):
        sys.exit(__doc__)
    name, flags = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, str(ROOT))
    from tests.parser_build import use_parser_build

    build = use_parser_build()
    if build is None:
        sys.exit("C_PARSER_BUILD names no build: run it through scripts/test-parser")
    import atheris

    seeds, corpus, crashes = (BUILD / part / name for part in ("seeds", "corpus", "crashes"))
    crashes.mkdir(parents=True, exist_ok=True)
    inputs = [flag for flag in flags if not flag.startswith("-")]
    if not inputs:  # libFuzzer runs given files once each, and fuzzes given folders
        inputs = [str(corpus), str(seeds)]
        corpus.mkdir(parents=True, exist_ok=True)
        print(f"{name}: {write_seeds(name, seeds)} seeds", flush=True)
    print(f"{name} on {build}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        defaults = [f"-max_len={SEED_BYTES}", f"-artifact_prefix={crashes}/"]
        options = [flag for flag in flags if flag.startswith("-")]
        argv = [sys.argv[0], *defaults, *options, *inputs]
        atheris.Setup(argv, target_of(name, Path(scratch)))
        atheris.Fuzz()


if __name__ == "__main__":
    main()
