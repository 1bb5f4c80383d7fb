"""gpuos's own nvidia-uvm logic in user space: patches/nvidia-uvm/uvm_gpuos_{isolate,report,
prefetch}.c (the fault-isolation rules, the fault batch report builder, the prefetch
clipping), compiled unchanged under ASan and UBSan with tests/nvidia/uvm_logic_user.c and
run against kmod/uvmtest/uvm_cases.h: fixed cases, then random runs checked against
references and for invariants (for the reports: that gpuos.ko accepts them).  The same
cases run in the kernel in the VM (tests/vm/test_36_uvm_logic.py).  Mutants of each file
must fail: the cases tell a wrong rule from the right one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SRC = ROOT / "patches" / "nvidia-uvm"
FILES = ("isolate", "report", "prefetch")

pytestmark = pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")


def build(tmp_path: Path, replace: dict[str, Path] | None = None, werror: bool = True) -> Path:
    """A mutant may leave a parameter unused: it is built without -Werror, to be run."""
    sources = [str((replace or {}).get(f, SRC / f"uvm_gpuos_{f}.c")) for f in FILES]
    exe = tmp_path / "uvm_logic_user"
    subprocess.run(["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", *(["-Werror"] if werror else []),
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                    f"-I{SRC}", f"-I{ROOT / 'kmod'}", f"-I{ROOT / 'kmod' / 'uvmtest'}",
                    str(ROOT / "tests" / "nvidia" / "uvm_logic_user.c"), *sources, "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def uvm_logic_user(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("uvm"))


@pytest.mark.parametrize("seed", ["1", "42", "0xdeadbeef"])
def test_logic_holds_under_sanitizers(uvm_logic_user, seed):
    p = subprocess.run([str(uvm_logic_user), seed, "5000"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "5000 random runs: 0 failed checks" in p.stdout


MUTANTS = {  # file, what it says -> a plausible mistake
    "isolate: no deadline": ("isolate", "now_ns > iso->deadline_ns || ", ""),
    "isolate: permission faults contained": ("isolate", "if (!unmapped) {", "if (0) {"),
    "isolate: giving up is not final": ("isolate", "if (iso->state == GPUOS_ISO_GAVE_UP)\n        goto stock;", ""),
    "isolate: no budget": ("isolate", "want <= limits->max_bytes - iso->mapped_bytes", "1"),
    "isolate: deadline wraps around": ("isolate", "iso->deadline_ns = ~0ull;", ";"),
    "isolate: regions not deduplicated": ("isolate", "if (batch->regions[j].base == base)\n            return;", ""),
    "report: pages not deduplicated": ("report", "(i > 0 && r->addrs[i - 1] == addr) || ", ""),
    "report: shift off by one": ("report", "j > i; j--", "j > i + 1; j--"),
    "report: unknown access counted anywhere": ("report", "access < __GPUOS_ACCESS_MAX ? access : GPUOS_ACCESS_ATOMIC", "access % 3"),
    "prefetch: wrap past the top": ("prefetch", "if (last < first)   // wrapped past the top\n            last = ~0ull;", ""),
    "prefetch: ranges above the block kept": ("prefetch", "first > block_last || ", ""),
    "prefetch: empty ranges kept": ("prefetch", "if (ranges[i].len == 0)\n            continue;", ""),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_wrong_rule_is_caught(tmp_path, mutant):
    which, old, new = MUTANTS[mutant]
    text = (SRC / f"uvm_gpuos_{which}.c").read_text()
    assert text.count(old) == 1, f"the code to mutate is no longer there: {old!r}"
    mutated = tmp_path / f"uvm_gpuos_{which}.c"
    mutated.write_text(text.replace(old, new))
    exe = build(tmp_path, {which: mutated}, werror=False)
    p = subprocess.run([str(exe), "1", "1000"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, f"mutant '{mutant}' passed every check:\n{p.stdout}"
