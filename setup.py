"""The compiled part of wattflow: hwpc-sensor's JSON lines and PowerAPI's CSV rows parsed in C
(formats/_hwpc_lines.c).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
built (no C compiler), wattflow installs without it, decodes JSON lines in Python only and
replays CSV row by row.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "wattflow.formats._hwpc_lines",
            sources=["formats/_hwpc_lines.c"],
            optional=True,
        )
    ]
)
