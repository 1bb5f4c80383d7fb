"""kernel/uapi.py mirrors kmod/uapi/gpuos.h exactly: every name, value, struct layout, ioctl.

A C program compiled against the header prints every enum member, every
#define, each struct's size and field offsets, and the ioctl numbers; the
Python mirror must give the same.  The list of names comes from the header
itself, so a name added there without a mirror fails here.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuos.kernel import uapi

HEADER = Path(__file__).resolve().parents[2] / "kmod" / "uapi" / "gpuos.h"
INCLUDE_GUARD = "_UAPI_LINUX_GPUOS_H"
FUNCTION_MACROS = {"GPUOS_DEST_GPU": uapi.DEST_GPU}


def _header_text() -> str:
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_enums() -> dict[str, list[str]]:
    """C enum name -> its member names, in order."""
    return {m.group(1): re.findall(r"(\w+)\s*(?:=[^,]*)?,", m.group(2))
            for m in re.finditer(r"\benum\s+(\w+)\s*\{(.*?)\}\s*;", _header_text(), re.S)}


def header_defines() -> tuple[list[str], list[str]]:
    """(object-like #define names, function-like #define names), include guard excluded."""
    objects, functions = [], []
    for name, paren in re.findall(r"^\s*#\s*define\s+(\w+)(\(?)", _header_text(), re.M):
        if name == INCLUDE_GUARD:
            continue
        (functions if paren else objects).append(name)
    return objects, functions


def header_structs() -> dict[str, list[str]]:
    return {m.group(1): re.findall(r"__[us]\d+\s+(\w+)\s*;", m.group(2))
            for m in re.finditer(r"\bstruct\s+(\w+)\s*\{(.*?)\}\s*;", _header_text(), re.S)}


def test_header_parses():
    enums, (defines, functions), structs = header_enums(), header_defines(), header_structs()
    assert "gpuos_attr" in enums and "GPUOS_A_DECISION" in enums["gpuos_attr"]
    assert "GPUOS_IOC_SUBMIT" in defines and functions == ["GPUOS_DEST_GPU"]
    assert structs["gpuos_range"] == ["base", "len", "dest", "prio", "flags", "status"]


def test_every_header_name_has_a_mirror_and_no_more():
    enums, (defines, functions) = header_enums(), header_defines()
    header_names = {n for members in enums.values() for n in members} | set(defines)
    mirrored = set(uapi.c_names())
    assert sorted(header_names - mirrored) == [], "names of the header without a Python mirror"
    assert sorted(mirrored - header_names) == [], "Python mirrors of names the header lacks"
    assert set(functions) == set(FUNCTION_MACROS)


def test_every_enum_is_mirrored_member_for_member():
    enums = header_enums()
    by_c_name = {c_name: (enum, prefix) for enum, c_name, prefix in uapi.ENUM_PREFIXES}
    plain = {c: [n for n in members if not n.startswith("__")] for c, members in enums.items()}
    assert set(plain) == set(by_c_name), "C enums and Python IntEnums differ"
    for c_name, members in plain.items():
        enum, prefix = by_c_name[c_name]
        assert [prefix + m.name for m in enum] == members, c_name


def test_every_struct_is_mirrored_field_for_field():
    structs = header_structs()
    assert set(structs) == set(uapi.STRUCTS)
    for name, fields in structs.items():
        assert [f[0] for f in uapi.STRUCTS[name]._fields_] == fields, name


def _c_program() -> str:
    enums, (defines, _) = header_enums(), header_defines()
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        f'#include "{HEADER}"',
        'static void pi(const char *n, long long v) { printf("%s %lld\\n", n, v); }',
        'static void ps(const char *n, const char *v) { printf("%s \\"%s\\"\\n", n, v); }',
        "#define P(x) _Generic((x), char *: ps, const char *: ps, default: pi)(#x, x)",
        "int main(void)",
        "{",
    ]
    for name in [n for members in enums.values() for n in members] + defines:
        lines.append(f"\tP({name});")
    for i in (0, 1, uapi.MAX_GPUS - 1):
        lines.append(f'\tprintf("GPUOS_DEST_GPU({i}) %lld\\n", (long long)GPUOS_DEST_GPU({i}));')
    for struct, fields in header_structs().items():
        lines.append(f'\tprintf("sizeof({struct}) %zu\\n", sizeof(struct {struct}));')
        lines.append(f'\tprintf("alignof({struct}) %zu\\n", _Alignof(struct {struct}));')
        for f in fields:
            lines.append(f'\tprintf("offsetof({struct}.{f}) %zu\\n", '
                         f'offsetof(struct {struct}, {f}));')
            lines.append(f'\tprintf("sizeof({struct}.{f}) %zu\\n", '
                         f'sizeof(((struct {struct} *)0)->{f}));')
    lines += ["\treturn 0;", "}"]
    return "\n".join(lines) + "\n"


def _python_values() -> dict[str, int | str]:
    values: dict[str, int | str] = dict(uapi.c_names())
    for i in (0, 1, uapi.MAX_GPUS - 1):
        values[f"GPUOS_DEST_GPU({i})"] = uapi.DEST_GPU(i)
    for struct, cls in uapi.STRUCTS.items():
        values[f"sizeof({struct})"] = ctypes.sizeof(cls)
        values[f"alignof({struct})"] = ctypes.alignment(cls)
        for name, ctype in cls._fields_:
            values[f"offsetof({struct}.{name})"] = getattr(cls, name).offset
            values[f"sizeof({struct}.{name})"] = ctypes.sizeof(ctype)
    return values


@pytest.fixture(scope="module")
def c_values(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int | str]:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    work = tmp_path_factory.mktemp("uapi")
    (work / "uapi.c").write_text(_c_program())
    build = subprocess.run([gcc, "-std=c11", "-Wall", "-Werror", "-o", str(work / "uapi"),
                            str(work / "uapi.c")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(work / "uapi")], capture_output=True, text=True, check=True).stdout
    values: dict[str, int | str] = {}
    for line in out.splitlines():
        name, value = line.rsplit(" ", 1) if not line.endswith('"') else line.split(" ", 1)
        values[name] = value[1:-1] if value.startswith('"') else int(value)
    return values


def test_c_program_prints_every_name(c_values):
    assert set(c_values) == set(_python_values())


def test_values_equal_the_header(c_values):
    py = _python_values()
    wrong = {k: (c_values[k], py[k]) for k in c_values if c_values[k] != py[k]}
    assert wrong == {}, "name: (C value, Python value)"


def test_ioctl_numbers():
    # _IOR('G', 0, __u32) and _IOWR('G', 1, struct gpuos_batch) on x86-64, by hand.
    assert uapi.IOC_ABI_VERSION == (2 << 30) | (4 << 16) | (ord("G") << 8) | 0
    assert uapi.IOC_SUBMIT == (3 << 30) | (40 << 16) | (ord("G") << 8) | 1


def test_the_header_says_range_is_32_bytes():
    assert ctypes.sizeof(uapi.GpuosRange) == 32 and "32 bytes" in HEADER.read_text()


def test_names_for_people():
    assert uapi.policy_name(uapi.FaultPolicy.KILL_CLIENT) == "kill-client"
    assert uapi.enum_name(uapi.EventType, 99) == "unknown-99"
    assert uapi.caps_names(uapi.DriverCaps.MIGRATE | uapi.DriverCaps.STOP_CLIENT | (1 << 9)) == \
        ["migrate", "stop-client", "bit-9"]
