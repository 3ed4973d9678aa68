"""Another build of the C parser (``formats/_hwpc_lines.c``) in place of the installed one.

``scripts/test-parser`` builds the parser twice more, with AddressSanitizer and
UndefinedBehaviorSanitizer (``build/asan/``) and with libFuzzer's coverage as well
(``build/fuzz/parser/``), and runs the parser's tests and the fuzzer on those builds. The variable
``C_PARSER_BUILD`` names the build's extension file: it is loaded here under the installed
module's name before anything imports that, so ``from wattflow.formats import _hwpc_lines`` in
``json_frames`` and ``csv_frames`` finds it. wattflow itself has no such switch: only the tests
(``tests/conftest.py``) and the fuzzer (``scripts/fuzz_parser.py``) read the variable, which is
named outside the ``WATTFLOW_`` settings that the ``wattflow`` command reads.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

MODULE = "wattflow.formats._hwpc_lines"
VARIABLE = "C_PARSER_BUILD"


def use_parser_build() -> str | None:
    """Load the build ``C_PARSER_BUILD`` names as the C parser; its path, or ``None`` when the
    variable is unset (the installed build then serves).

    Raises:
        RuntimeError: when the installed parser was imported first: the tests would then run on
            it while claiming to run on the other build.
    """
    path = os.environ.get(VARIABLE)
    if not path:
        return None
    if MODULE in sys.modules:
        raise RuntimeError(f"{MODULE} was imported before {VARIABLE}={path} could replace it")
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    assert spec is not None, path
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE] = module
    import wattflow.formats

    wattflow.formats._hwpc_lines = module  # type: ignore[attr-defined]
    return os.path.abspath(path)
