"""The layering of the code, read from every module's imports (those inside functions too).

mla_constants < reference, fast < harness < recording < pytest_sparse_mla, scripts, bench < tests:
a module imports only from its own package and from lower layers. Packages of one layer never
import each other (reference and fast in particular), and nothing outside tests/ imports tests.
No module imports a test module (``tests/**/test_*.py``): what test modules share lives in
``tests/support/`` and ``tests/*.py``.

harness/, recording/ and the plugin (pytest_sparse_mla/) reach a vendor only through the backend
seam: they import no vendor package (FlashInfer, vLLM, FlashMLA), none of the modules that wrap
one, and from backends/ only the seam and the registry (:data:`SEAM_MODULES`); the registry
answers what the plugin asks of the vendor packages. The studies of the port's own state (its graphs,
kept plans, scale and plan limits) live in harness/port/ (:data:`PORT_WING`); they, and
:data:`PORT_STUDIES_ELSEWHERE` (the reruns of the port's fixtures), may also import the port's API,
``backends.flashinfer.port``; no other module of harness/ or recording/ may.
fast/ holds the port's host stages: it imports no vendor package (FlashInfer's wrapper and the
port's attention state are backends/').

backends/ holds one package per vendor (:data:`VENDOR_PACKAGES`: ``backends.flashinfer``, the
port and what it reads of FlashInfer; ``backends.vllm``, vLLM's own modules and FlashMLA's kernels
as a release calls them) and, beside them, only the seam and the registry
(:data:`BACKENDS_TOP`). A vendor package builds only on those before it in that order (vLLM's
backend runs on FlashInfer's kernels and reads their schedule; the port never imports vLLM), and
the seam imports no vendor package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# top-level package or module -> layer; equal layers are peers that must not import each other
LAYERS = {
    "mla_constants": 0,
    "reference": 1,
    "fast": 1,
    "backends": 2,
    "harness": 3,
    "recording": 4,
    "pytest_sparse_mla": 5,
    "scripts": 5,
    "bench": 5,
    "tests": 6,
    "conftest": 6,  # the root conftest.py loads the plugin for the tests
}
#: What harness/ and recording/ may import from backends/.
SEAM_MODULES = ("backends.seam", "backends.registry")
#: The port's API, for the studies of the port's own state alone.
PORT_API = "backends.flashinfer.port"
#: The folder of the studies of the port's own state: every module under it drives the port
#: through its API, and no module of harness/ outside it may import that API.
PORT_WING = Path("harness", "port")
#: Studies of the port's state outside :data:`PORT_WING`, named one by one. ``recording.rerun``
#: re-runs a recorded fixture on the port, and it reads that fixture through recording/ (its
#: format, environment and replay verdict): recording/ is above harness/, so under harness/port/
#: it could not import them.
PORT_STUDIES_ELSEWHERE = ("recording.rerun",)
#: Vendor packages and the project's modules that wrap them.
VENDOR_MODULES = ("flashinfer", "vllm", "flash_mla", "backends.flashinfer.compat", "backends.flashinfer.sm90_state")
#: The vendor packages of backends/, each building only on those before it.
VENDOR_PACKAGES = ("backends.flashinfer", "backends.vllm")
#: The vendor code each vendor package may import (vLLM's own modules are loaded from the
#: release at test time, under their own names, by ``backends.vllm.shims``).
VENDOR_OF_PACKAGE = {"backends.flashinfer": ("flashinfer",), "backends.vllm": ("vllm", "flash_mla", "flashinfer")}
#: What backends/ holds beside its vendor packages.
BACKENDS_TOP = ("backends", "backends.seam", "backends.registry")
BEHIND_THE_SEAM = ("harness", "recording")
#: The plugin reaches backends/ only through the registry (and the seam's records): it imports no
#: vendor package and no module of a vendor package.
PLUGIN = "pytest_sparse_mla"
#: Packages that import no vendor package at all.
HOST_STAGES = ("fast",)
SKIPPED_DIRS = {"venv", "build", "dist", "__pycache__", "node_modules", "mutants"}  # mutants: mutmut's work folder


def project_modules(root: Path = ROOT) -> list[Path]:
    """Every .py file of the project: folders such as a virtual environment, and every hidden
    file or folder (.git, .venv, a tool's cache or work folder), left out."""
    return sorted(p for p in root.rglob("*.py")
                  if not SKIPPED_DIRS.intersection(p.relative_to(root).parts)
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def top_level_of(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else path.stem


def imported_modules(source: str, path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the source: module level, inside
    functions, relative ones resolved, and ``importlib.import_module("name")`` with a literal
    absolute name."""
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and not node.args[0].value.startswith(".")):
            found.append((node.lineno, node.args[0].value))
    return found


def layering_violations(root: Path = ROOT) -> list[str]:
    """One line per import that goes against the layering, naming the file, line and module."""
    problems = []
    for path in project_modules(root):
        here = top_level_of(path, root)
        rel = path.relative_to(root)
        if here not in LAYERS:
            problems.append(f"{rel}: top-level '{here}' has no layer (add it to LAYERS and docs/code-map.md)")
            continue
        for line, module in imported_modules(path.read_text(), path, root):
            there = module.split(".")[0]
            if there == here or there not in LAYERS:
                continue
            if LAYERS[there] >= LAYERS[here]:
                kind = "a peer" if LAYERS[there] == LAYERS[here] else "a higher layer"
                problems.append(f"{rel}:{line}: '{here}' imports '{module}' from {kind}")
    return problems


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules of its own top-level package it imports (anywhere in it);
    ``from . import x`` names the module x where x is one."""
    paths = {module_name(p, root): p for p in project_modules(root)}
    graph = {}
    for name, path in paths.items():
        package = list(path.relative_to(root).with_suffix("").parts[:-1])
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
                        if node.level else node.module)
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        top = name.split(".")[0]
        graph[name] = {t for t in targets if t in paths and t != name and t.split(".")[0] == top}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def test_no_import_cycle_inside_a_package():
    """Module-level and function-level imports alike: a cycle hidden in a function is still one."""
    cycles = import_cycles(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg import a\n")
    assert import_cycles(import_graph(tmp_path)) == [["pkg.a", "pkg.b"]]


def imports_breaking(rule, root: Path = ROOT) -> list[str]:
    """``path:line: problem`` for every import of every project module that ``rule(path, module)``
    names a problem of (None: the import is fine)."""
    return [f"{path.relative_to(root)}:{line}: {problem}" for path in project_modules(root)
            for line, module in sorted(imported_modules(path.read_text(), path, root))
            for problem in [rule(path, module)] if problem]


def in_port_wing(path: Path, root: Path = ROOT) -> bool:
    """Whether the module lives under :data:`PORT_WING` (a folder of it too)."""
    return path.relative_to(root).parts[: len(PORT_WING.parts)] == PORT_WING.parts


def is_port_study(path: Path, root: Path = ROOT) -> bool:
    """Whether the module studies the port's own state: it lives under :data:`PORT_WING`, or it
    is one of :data:`PORT_STUDIES_ELSEWHERE`."""
    return in_port_wing(path, root) or module_name(path, root) in PORT_STUDIES_ELSEWHERE


def vendor_imports(root: Path = ROOT) -> list[str]:
    """One line per import in harness/, recording/ or the plugin of a vendor module, or of a
    backends module other than the seam and the registry (the port's API allowed in the port's
    state studies, :func:`is_port_study`); and per import in fast/ of a vendor module."""

    def past_the_seam(path: Path, module: str) -> str | None:
        top = top_level_of(path, root)
        if top not in BEHIND_THE_SEAM + HOST_STAGES + (PLUGIN,):
            return None
        allowed = SEAM_MODULES + ((PORT_API,) if is_port_study(path, root) else ())
        vendor = (any(module == v or module.startswith(v + ".") for v in VENDOR_MODULES)
                  or (vendor_package_of(module) is not None and module not in allowed))
        past_seam = top in BEHIND_THE_SEAM + (PLUGIN,) and module.startswith("backends") and module not in allowed
        return f"imports {module} (reach it through backends.seam)" if vendor or past_seam else None

    return imports_breaking(past_the_seam, root)


def test_harness_and_recording_reach_vendors_only_through_the_seam():
    problems = vendor_imports()
    assert not problems, "\n".join(problems)


def test_the_seam_check_sees_a_vendor_import(tmp_path):
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "x.py").write_text("def f():\n    from flashinfer.mla import W\n"
                                              "from backends.vllm.sm90 import L\nfrom backends.seam import S\n")
    found = vendor_imports(tmp_path)
    assert [p.split(": ")[1] for p in found] == ["imports flashinfer.mla (reach it through backends.seam)",
                                                 "imports backends.vllm.sm90 (reach it through backends.seam)"]


def test_the_seam_check_sees_the_plugin_reach_past_the_registry(tmp_path):
    (tmp_path / "pytest_sparse_mla").mkdir()
    (tmp_path / "pytest_sparse_mla" / "x.py").write_text(
        "from backends.registry import open_backend\nfrom backends.vllm.source import resolve\n"
        "def f():\n    from flashinfer.mla import W\n    from backends.flashinfer import port\n")
    assert [p.split(": ")[1] for p in vendor_imports(tmp_path)] == [
        "imports backends.vllm.source (reach it through backends.seam)",
        "imports flashinfer.mla (reach it through backends.seam)",
        "imports backends.flashinfer (reach it through backends.seam)"]


def test_the_seam_check_sees_a_vendor_import_in_the_host_stages(tmp_path):
    (tmp_path / "fast").mkdir()
    (tmp_path / "fast" / "x.py").write_text("def f():\n    import flashinfer\nimport torch\n")
    assert [p.split(": ")[1] for p in vendor_imports(tmp_path)] == [
        "imports flashinfer (reach it through backends.seam)"]


def test_no_module_imports_from_a_higher_layer_or_a_peer():
    assert layering_violations() == [], "\n".join(layering_violations())


def test_every_top_level_package_is_scanned():
    scanned = {top_level_of(p) for p in project_modules()}
    assert scanned == set(LAYERS), f"scanned {sorted(scanned)}, layered {sorted(LAYERS)}"


@pytest.mark.parametrize(
    "rel, source, expected",
    [
        ("harness/x.py", "def f():\n    from recording.case_log import note_step\n",
         ["'harness' imports 'recording.case_log'"]),
        ("reference/x.py", "import fast.layouts\n", ["'reference' imports 'fast.layouts' from a peer"]),
        ("harness/x.py", "from .scenario import build_scenario\nimport torch\n", []),
        ("recording/sub/x.py", "from ...tests import bugs\n", ["'recording' imports 'tests' from a higher layer"]),
        ("fast/x.py", "import importlib\nm = importlib.import_module('harness.scale')\n",
         ["'fast' imports 'harness.scale'"]),
        ("tests/x.py", "from recording.case_log import note_step\n", []),
    ],
)
def test_the_check_sees_hidden_relative_and_dynamic_imports(tmp_path, rel, source, expected):
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_text(source)
    problems = layering_violations(tmp_path)
    assert len(problems) == len(expected), problems
    for problem, want in zip(problems, expected, strict=True):
        assert want in problem and rel in problem, problem


def test_the_seam_check_lets_only_the_port_studies_import_the_port(tmp_path):
    """Under harness/port/ (a sub-package too) and in recording/rerun.py the port's API is allowed;
    anywhere else in harness/ or recording/ it is not, a module named as a study but outside the
    folder (harness/launch.py) or in a folder whose name only starts alike (harness/portable/)
    included."""
    port_import = "from backends.flashinfer.port import make_attention_state\n"
    for rel in ("harness/port/launch.py", "harness/port/sub/study.py", "recording/rerun.py", "harness/launch.py",
                "harness/portable/x.py", "recording/replay.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(port_import)
    (tmp_path / "harness" / "judge.py").write_text("from backends.flashinfer.port import PortBackend\n"
                                                  "from backends.registry import open_backend\n")
    found = vendor_imports(tmp_path)
    outside = ("harness/judge.py", "harness/launch.py", "harness/portable/x.py", "recording/replay.py")
    assert found == [f"{rel}:1: imports backends.flashinfer.port (reach it through backends.seam)" for rel in outside]


def test_every_port_study_named_exists_and_uses_the_port():
    """Every module under harness/port/ (its ``__init__`` aside) and every one of
    :data:`PORT_STUDIES_ELSEWHERE` exists and imports the port's API: a module that stopped
    studying the port leaves the folder or the list, so neither grows stale."""
    paths = {module_name(p): p for p in project_modules()}
    wing = [name for name, path in paths.items() if in_port_wing(path) and path.name != "__init__.py"]
    assert wing, f"no port studies found under {PORT_WING}"
    stale = [name for name in [*wing, *PORT_STUDIES_ELSEWHERE]
             if name not in paths
             or PORT_API not in {module for _, module in imported_modules(paths[name].read_text(), paths[name])}]
    assert stale == [], f"port studies that do not import {PORT_API}: {stale}"


def imports_of_test_modules(root: Path = ROOT) -> list[str]:
    """One line per import of a test module (``tests/**/test_*.py``) by any module: what the
    test modules share lives in ``tests/support/`` and ``tests/*.py``, so that no test module
    depends on another's fixtures, helpers or collection."""

    def a_test_module(path: Path, module: str) -> str | None:
        is_test_module = module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
        return f"imports the test module {module}" if is_test_module else None

    def names_imported_from_tests(path: Path) -> list[tuple[int, str]]:
        """(line, ``package.name``) of every ``from tests... import name``: the name may be a module."""
        tree = ast.parse(path.read_text(), filename=str(path))
        return [(node.lineno, f"{node.module}.{alias.name}") for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and not node.level and node.module
                and node.module.split(".")[0] == "tests" for alias in node.names]

    by_name = [f"{path.relative_to(root)}:{line}: {problem}" for path in project_modules(root)
               for line, module in names_imported_from_tests(path)
               for problem in [a_test_module(path, module)] if problem]
    return imports_breaking(a_test_module, root) + by_name


def test_no_module_imports_a_test_module():
    problems = imports_of_test_modules()
    assert not problems, "\n".join(problems)


def test_the_test_module_check_sees_one_imported_inside_a_function(tmp_path):
    (tmp_path / "tests" / "cpu").mkdir(parents=True)
    (tmp_path / "tests" / "cpu" / "test_a.py").write_text("def f():\n    from tests.cpu.test_b import helper\n")
    (tmp_path / "tests" / "support.py").write_text("from tests.cpu import conftest\n")
    (tmp_path / "tests" / "cpu" / "test_c.py").write_text("def g():\n    from tests import test_replay\n")
    assert [p.split(": ")[1] for p in imports_of_test_modules(tmp_path)] == [
        "imports the test module tests.cpu.test_b", "imports the test module tests.test_replay"]


#: Names that single out a vendor or family of backends; the judge asks each backend's family
#: (``harness.findings.for_backend``) and its declared capabilities instead.
VENDOR_WORDS = re.compile(r"vllm|flashmla|flash_mla|design", re.IGNORECASE)


def vendor_names_in_code(source: str) -> list[str]:
    """``line: name`` of each identifier or string literal (not a docstring or comment) naming a
    vendor in ``source``."""
    import ast

    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        else:
            continue
        if VENDOR_WORDS.search(text):
            found.append(f"{node.lineno}: {text}")
    return found


def test_the_judge_names_no_vendor():
    """harness/judge.py judges every backend alike: no identifier or string of its code names vLLM
    or FlashMLA (their findings live in harness/findings/<family>.py)."""
    assert vendor_names_in_code((ROOT / "harness" / "judge.py").read_text()) == []


def test_the_judge_runs_no_case_and_the_runner_judges_through_it_alone():
    """The judge (harness/judge.py) judges one step and knows nothing of running cases: it imports
    neither the case runner nor the case log's noting of a case; the runner
    (harness/case_runner.py) reaches the judge's verdict only through ``judge_step``, and the
    plugin's reporter runs no judge of its own."""
    judge = ROOT / "harness" / "judge.py"
    assert not [m for _, m in imported_modules(judge.read_text(), judge) if m.startswith("harness.case_runner")]
    assert "note_backend_case" not in judge.read_text()
    runner = ast.parse((ROOT / "harness" / "case_runner.py").read_text())
    called = {n.func.id for n in ast.walk(runner) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "judge_step" in called
    plugin = (ROOT / "pytest_sparse_mla" / "judge.py").read_text()
    assert "judge_step(" not in plugin and "judged_step(" in plugin


def test_the_vendor_name_check_sees_a_branch_on_a_vendor():
    assert vendor_names_in_code('"""about vLLM"""\nif is_vllm_backend(b):\n    x = b.design\n# vllm\n') == \
        ["2: is_vllm_backend", "3: design"]


def listed_packages(pyproject: str) -> list[str]:
    """The packages ``[tool.setuptools] packages`` lists in the text of ``pyproject.toml``."""
    match = re.search(r"^packages\s*=\s*\[([^\]]*)\]", pyproject, re.MULTILINE)
    return re.findall(r'"([^"]+)"', match.group(1)) if match else []


def test_every_package_of_the_project_is_listed_for_the_wheel():
    """A package missing from pyproject.toml's list works from a checkout or an editable install
    and is left out of a built wheel: every folder with an __init__.py is listed, but those run from
    a checkout (the tests, the benchmark and the scripts)."""
    from_checkout = {"tests", "bench", "scripts"}
    folders = [p.parent.relative_to(ROOT).parts for p in ROOT.glob("*/**/__init__.py")]
    found = sorted(".".join(parts) for parts in folders
                   if parts[0] in LAYERS and parts[0] not in from_checkout and not SKIPPED_DIRS & set(parts))
    assert sorted(listed_packages((ROOT / "pyproject.toml").read_text())) == found


def vendor_package_of(module: str) -> str | None:
    """The vendor package of backends/ that ``module`` belongs to, or None."""
    return next((p for p in VENDOR_PACKAGES if module == p or module.startswith(p + ".")), None)


def backend_modules_outside_a_vendor_package(root: Path = ROOT) -> list[str]:
    """Every module of backends/ that is neither in a vendor package nor one of :data:`BACKENDS_TOP`."""
    return sorted(name for name in map(lambda p: module_name(p, root), project_modules(root))
                  if name.split(".")[0] == "backends" and name not in BACKENDS_TOP and vendor_package_of(name) is None)


def vendor_package_crossings(root: Path = ROOT) -> list[str]:
    """One line per import that breaks the vendor packages' order: a vendor package importing a
    later one or another vendor's code than its own (:data:`VENDOR_OF_PACKAGE`), and the seam
    importing any vendor package or vendor."""
    order = {p: i for i, p in enumerate(VENDOR_PACKAGES)}
    vendors = {v for vs in VENDOR_OF_PACKAGE.values() for v in vs}

    def crossing(path: Path, module: str) -> str | None:
        here = module_name(path, root)
        there_package = vendor_package_of(module)
        vendor = module.split(".")[0] if module.split(".")[0] in vendors else None
        if here == "backends.seam":
            return f"the seam imports {module}" if there_package or vendor else None
        package = vendor_package_of(here)
        if package is None:
            return None
        if there_package is not None and order[there_package] > order[package]:
            return f"{package} imports {module}, of a vendor package after it"
        if vendor is not None and vendor not in VENDOR_OF_PACKAGE[package]:
            return f"{package} imports {module}, another vendor's code"
        return None

    return imports_breaking(crossing, root)


def test_backends_hold_one_package_per_vendor_beside_the_seam_and_the_registry():
    assert backend_modules_outside_a_vendor_package() == []
    for name in VENDOR_PACKAGES:
        assert (ROOT / Path(*name.split(".")) / "__init__.py").is_file(), f"vendor package {name} is missing"


def test_vendor_packages_build_only_on_those_before_them():
    problems = vendor_package_crossings()
    assert not problems, "\n".join(problems)


def test_the_vendor_package_checks_see_a_module_astray_and_an_import_against_the_order(tmp_path):
    for rel, source in {"backends/__init__.py": "", "backends/seam.py": "from backends.vllm.source import V\n",
                        "backends/registry.py": "", "backends/helper.py": "",
                        "backends/flashinfer/__init__.py": "",
                        "backends/flashinfer/port.py": "def f():\n    from ..vllm import sm90\nimport flashinfer\n",
                        "backends/flashinfer/wrap.py": "import vllm.config\n",
                        "backends/vllm/__init__.py": "",
                        "backends/vllm/sm90.py": "from ..flashinfer import port\nimport flashinfer\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    assert backend_modules_outside_a_vendor_package(tmp_path) == ["backends.helper"]
    assert [p.split(": ", 1)[1] for p in vendor_package_crossings(tmp_path)] == [
        "backends.flashinfer imports backends.vllm, of a vendor package after it",
        "backends.flashinfer imports vllm.config, another vendor's code",
        "the seam imports backends.vllm.source",
    ]


def test_every_backend_family_opens_from_a_vendor_package():
    """The registry's table points into the vendor packages: a family's module and its facts."""
    from backends.registry import FAMILIES

    astray = {name: (f.module, f.facts) for name, f in FAMILIES.items()
              if vendor_package_of(f.module) is None or (f.facts is not None and vendor_package_of(f.facts) is None)}
    assert astray == {}
