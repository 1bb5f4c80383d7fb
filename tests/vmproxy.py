"""The vm tests (tests/vm, marker vm) run in a VM guest; on the host, proxies report them.

On the host (GPUOS_IN_VM unset) the modules under tests/vm are never imported, as they
may import what only the guest has (pyroute2, bcc). Their tests are read from the
source instead (test* functions, test* methods of Test* classes) and become proxy
items with the guest's node ids and the marker vm. The first proxy that runs boots the
VM once for all the proxies the session selected (tools/vmtest/vmtest.py test), and
each proxy reports its test's outcome from the guest's JUnit XML: a failure with the
guest's text, a skip, or a failure when the guest has no result for it. A parametrized
test is one proxy for all its cases. Deselected proxies (-m "gpu or criu") boot
nothing; GPUOS_SKIP_VM=1 skips them. A tests/vm/conftest.py is imported on the host
too: it must import guest-only modules inside its fixtures.

In the guest the tests run as usual, each under tests/vm with the marker vm.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

VM_DIR = Path(__file__).parent / "vm"
VMTEST = Path(__file__).parents[1] / "tools" / "vmtest" / "vmtest.py"
IN_VM = bool(os.environ.get("GPUOS_IN_VM"))
PROXIES, RESULTS = pytest.StashKey[list](), pytest.StashKey[tuple]()


def pytest_pycollect_makemodule(module_path, parent):
    if not IN_VM and VM_DIR in Path(module_path).parents:
        return VmModule.from_parent(parent, path=Path(module_path))
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(session, items):
    for item in items:
        if VM_DIR in item.path.parents:
            item.add_marker(pytest.mark.vm)
    session.stash[PROXIES] = [item for item in items if isinstance(item, VmTest)]


class GuestFailure(Exception):
    """A test's failure in the guest; its text is the whole report."""


def tests_in(parent, body, prefix):
    """Proxies for the test* functions in BODY (ast) and the classes named PREFIX*."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            item = VmTest.from_parent(parent, name=node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith(prefix):
            item = VmClass.from_parent(parent, name=node.name)
            item.body = node.body
        else:
            continue
        item.lineno = node.lineno - 1
        yield item


class VmModule(pytest.File):
    def collect(self):
        return tests_in(self, ast.parse(self.path.read_bytes(), str(self.path)).body, "Test")


class VmClass(pytest.Collector):
    def collect(self):
        return tests_in(self, self.body, "\0")  # no nested classes


class VmTest(pytest.Item):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.add_marker(pytest.mark.vm)

    def runtest(self):
        if os.environ.get("GPUOS_SKIP_VM") == "1":
            raise pytest.skip.Exception("GPUOS_SKIP_VM=1", _use_item_location=True)
        if RESULTS not in self.session.stash:
            self.session.stash[RESULTS] = run_guest(self.session)
        results, log = self.session.stash[RESULTS]
        if results is None:
            raise GuestFailure(log)
        module, key = junit_key(self.path_id), junit_key(self.nodeid)
        if (broken := results.get("." + module)) and broken[1] == "failed":
            raise GuestFailure(f"{self.path_id} could not be collected in the VM:\n{broken[2]}")
        cases = [r for k, r in results.items() if k == key or k.startswith(key + "[")]
        if not cases:
            raise GuestFailure(f"no result for {self.nodeid} from the guest\n{log}")
        if failed := [f"{name} failed in the VM:\n{text}" for name, outcome, text in cases
                      if outcome == "failed"]:
            raise GuestFailure("\n\n".join(failed))
        if all(outcome == "skipped" for _, outcome, _ in cases):
            raise pytest.skip.Exception(cases[0][2], _use_item_location=True)

    @property
    def path_id(self) -> str:
        return self.nodeid.split("::")[0]

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, GuestFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, self.lineno, self.nodeid.split("::", 1)[1].replace("::", ".")


def run_guest(session) -> tuple[dict | None, str]:
    """Boot the VM once for the selected proxies: ({junit key: (name, outcome, text)} or None, log).

    The guest gets a module's path when all its tests are selected, else their node ids:
    an id in a module that cannot be imported would stop the guest's whole pytest run.
    """
    selected = [item for item in session.items if isinstance(item, VmTest)]
    args = []
    for path in dict.fromkeys(item.path_id for item in selected):
        ids = [item.nodeid for item in selected if item.path_id == path]
        whole = len(ids) == sum(item.path_id == path for item in session.stash[PROXIES])
        args += [path] if whole else ids
    out = Path(tempfile.mkdtemp(prefix="gpuos-vm-"))
    p = subprocess.run([sys.executable, str(VMTEST), "test", "--out", str(out), "--",
                        "--continue-on-collection-errors", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = "\n".join(p.stdout.splitlines()[-60:])
    log = f"--- tools/vmtest/vmtest.py test exited {p.returncode}; its last lines:\n{log}"
    if not (out / "junit.xml").exists():
        return None, f"the VM gave no test results (GPUOS_SKIP_VM=1 skips the vm tests)\n{log}"
    junit = ET.parse(out / "junit.xml").getroot()
    if p.returncode == 0:  # else keep the console log and the rest for a look
        shutil.rmtree(out)
    results = {}
    for case in junit.iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error")), None)
        skip = case.find("skipped")
        results[f"{case.get('classname')}.{case.get('name')}"] = (case.get("name"), *(
            ("failed", bad.text or bad.get("message", "")) if bad is not None else
            ("skipped", skip.get("message", "")) if skip is not None else ("passed", "")))
    return results, log


def junit_key(nodeid: str) -> str:
    """classname.name as pytest's JUnit XML writes them for this node id."""
    path, *names = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *names])
