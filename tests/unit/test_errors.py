"""Every error has its own exit code, and both exit-code tables list every one."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from gpuos import errors
from gpuos.cli.main import EXIT_CODES_HELP
from gpuos.errors import ALL_ERRORS, GpuosError

DOCS_CLI = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_all_errors_is_complete():
    defined = {obj for _, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, GpuosError)}
    assert defined == set(ALL_ERRORS)


def test_exit_codes_are_distinct():
    codes = [e.exit_code for e in ALL_ERRORS]
    assert len(codes) == len(set(codes)), sorted(codes)
    assert all(isinstance(c, int) and 1 <= c <= 125 for c in codes)
    assert 2 not in codes  # click's usage errors


def test_kinds_are_distinct():
    kinds = [e.kind for e in ALL_ERRORS]
    assert len(kinds) == len(set(kinds))


def test_message_is_kept():
    exc = errors.PidTaken("pid 5 is taken")
    assert exc.message == "pid 5 is taken" and str(exc) == "pid 5 is taken"


def _help_table() -> dict[int, str]:
    rows: dict[int, str] = {}
    for line in EXIT_CODES_HELP.splitlines():
        for code, text in re.findall(r"(?:^|\s{2,})(\d{1,3}) (\S.*?)(?=\s{2,}\d{1,3} |$)", line):
            assert int(code) not in rows, f"code {code} listed twice"
            rows[int(code)] = text.strip()
    return rows


def test_cli_help_lists_every_exit_code_once():
    rows = _help_table()
    assert {0, 1, 2} <= set(rows)
    for err in ALL_ERRORS:
        assert err.exit_code in rows, f"{err.__name__} (exit {err.exit_code}) missing from EXIT_CODES_HELP"
    assert set(rows) == {e.exit_code for e in ALL_ERRORS} | {0, 2}


def test_docs_table_lists_every_exit_code_with_its_kind():
    if not DOCS_CLI.is_file():
        pytest.skip("docs/cli.md not written yet")
    rows: dict[int, str] = {}
    for line in DOCS_CLI.read_text().splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|\s*(?:`([a-z-]+)`)?\s*\|", line)
        if m:
            assert int(m.group(1)) not in rows, f"code {m.group(1)} listed twice in docs/cli.md"
            rows[int(m.group(1))] = m.group(2) or ""
    for err in ALL_ERRORS:
        assert err.exit_code in rows, f"{err.__name__} (exit {err.exit_code}) missing from docs/cli.md"
        assert rows[err.exit_code] == err.kind, f"docs/cli.md gives exit {err.exit_code} kind " \
                                                f"{rows[err.exit_code]!r}, the code says {err.kind!r}"
    assert set(rows) == {e.exit_code for e in ALL_ERRORS} | {0, 2}
