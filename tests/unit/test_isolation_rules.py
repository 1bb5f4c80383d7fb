"""nvidia-uvm's fault-isolation rules (patches/nvidia-uvm/uvm_gpuos_isolate.c) in user
space: the file compiled unchanged under ASan and UBSan with tests/nvidia/isolate_user.c,
run against kmod/isotest/isolate_cases.h (fixed cases, then random runs of one client
checked for invariants).  The same cases run in the kernel in the VM
(tests/vm/test_36_isolation_rules.py).  Mutants of the rules must fail: the cases can
tell a wrong rule from the right one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RULES = ROOT / "patches" / "nvidia-uvm" / "uvm_gpuos_isolate.c"

pytestmark = pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")


def build(tmp_path: Path, rules: Path, werror: bool = True) -> Path:
    """A mutant may leave a parameter unused: it is built without -Werror, to be run."""
    exe = tmp_path / "isolate_user"
    subprocess.run(["gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", *(["-Werror"] if werror else []),
                    "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    "-fno-omit-frame-pointer", f"-I{RULES.parent}", f"-I{ROOT / 'kmod' / 'isotest'}",
                    str(ROOT / "tests" / "nvidia" / "isolate_user.c"), str(rules), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def isolate_user(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("iso"), RULES)


@pytest.mark.parametrize("seed", ["1", "42", "0xdeadbeef"])
def test_rules_hold_under_sanitizers(isolate_user, seed):
    p = subprocess.run([str(isolate_user), seed, "5000"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"5000 random runs: 0 failed checks" in p.stdout


MUTANTS = {  # what the rule says -> a plausible mistake
    "no deadline": ("now_ns > iso->deadline_ns || ", ""),
    "permission faults contained": ("if (!faults[i].unmapped)", "if (0)"),
    "giving up is not final": ("if (iso->state == GPUOS_ISO_GAVE_UP)\n        return GPUOS_ISO_STOCK;", ""),
    "no budget": ("want <= limits->max_bytes - iso->mapped_bytes", "1"),
    "deadline wraps around": ("iso->deadline_ns = ~0ull;", ";"),
    "regions not deduplicated": ("if (j < *nr_regions)\n            continue;", ""),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_wrong_rule_is_caught(tmp_path, mutant):
    old, new = MUTANTS[mutant]
    text = RULES.read_text()
    assert text.count(old) == 1, f"the rule to mutate is no longer there: {old!r}"
    mutated = tmp_path / "uvm_gpuos_isolate.c"
    mutated.write_text(text.replace(old, new))
    exe = build(tmp_path, mutated, werror=False)
    p = subprocess.run([str(exe), "1", "2000"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, f"mutant '{mutant}' passed every check:\n{p.stdout}"
