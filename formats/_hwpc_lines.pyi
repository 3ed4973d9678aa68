"""hwpc-sensor's JSON lines and PowerAPI's CSV rows parsed in C straight into int64 columns
(formats/_hwpc_lines.c)."""

from collections.abc import Sequence

Parsed = tuple[
    list[str],
    list[int | str],
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    list[tuple[str, tuple[str, ...], bytearray, bytearray, bytearray, bytearray]],
]

def parse(lines: Sequence[bytes | str], /) -> Parsed | None: ...

CsvParsed = tuple[list[str], bytearray, bytearray, bytearray, bytearray, bytearray, bytearray]

def parse_csv(data: bytes | bytearray | memoryview, cells: int, /) -> CsvParsed | None: ...
