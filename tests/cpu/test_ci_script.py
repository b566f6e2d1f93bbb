"""``.ci/run``'s GPU-tier run on the simulated SM90 machine: it runs under the pytest flags the
GPU runner gives (``scripts/gpu_runner.py``), so that a test that works only under the flags
of a CPU run (the pytest cache, say) fails in CI as it fails on the runner; it names GPU-tier
files only, the FlashMLA ones among them, and tests the vLLM wheel CI downloads."""

from __future__ import annotations

import shlex
from pathlib import Path

from scripts.gpu_runner import build_pytest_command

ROOT = Path(__file__).resolve().parents[2]
CI_SCRIPT = ROOT / ".ci" / "run"
SIMULATED = "tests.simulated_sm90"
#: The runner's own plugin (junit properties for its table), which only the runner loads.
RUNNER_PLUGIN = "gpu_runner"


def pytest_runs() -> list[list[str]]:
    """The words of each pytest command of the script (continued lines joined, comments and
    leading variable assignments dropped)."""
    text = CI_SCRIPT.read_text().replace("\\\n", " ")
    runs = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]
        if words[:3] == ["python3", "-m", "pytest"]:
            runs.append(words[3:])
    return runs


def simulated_run() -> list[str]:
    runs = [r for r in pytest_runs() if SIMULATED in r]
    assert len(runs) == 1, runs
    return runs[0]


def option_values(words: list[str], option: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == option]


def test_the_simulated_run_has_the_gpu_runners_flags():
    runner = build_pytest_command(Path("junit.xml"), [])[3:]
    run = simulated_run()
    for option in ("-p", "-n"):
        wanted = [v for v in option_values(runner, option) if v != RUNNER_PLUGIN]
        assert wanted and set(wanted) <= set(option_values(run, option)), (option, wanted, run)
    assert "no:cacheprovider" in option_values(run, "-p")


def test_the_simulated_run_names_gpu_tier_files_flashmla_among_them():
    files = [w for w in simulated_run() if w.startswith("tests/")]
    assert "tests/gpu/test_flashmla.py" in files, files
    for name in files:
        assert name.startswith("tests/gpu/test_") and (ROOT / name).is_file(), name
    # the real kernels' own contracts: a stand-in cannot check them
    assert "tests/gpu/test_flashmla_contract.py" not in files


def test_the_simulated_run_tests_the_wheel_ci_downloads():
    vllm_runs = [r for r in pytest_runs() if option_values(r, "-m") == ["vllm"]]
    assert len(vllm_runs) == 1, pytest_runs()
    wheel = [w for w in vllm_runs[0] if w.startswith("--vllm=")]
    assert wheel and wheel == [w for w in simulated_run() if w.startswith("--vllm=")], (wheel, simulated_run())
