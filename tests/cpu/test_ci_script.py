"""``.ci/run``'s GPU-tier run on the simulated SM90 machine: it is the GPU runner's own
(``scripts/gpu_runner.py --simulated``), so that it runs under the pytest flags the runner gives
every GPU session and a test that works only under the flags of a CPU run (the pytest cache,
say) fails in CI as it fails on the runner; its files are GPU-tier files, the FlashMLA ones among
them, and it tests the vLLM wheel CI downloads."""

from __future__ import annotations

import shlex
from pathlib import Path

from scripts.gpu_runner import SIMULATED_FILES, build_pytest_command

ROOT = Path(__file__).resolve().parents[2]
CI_SCRIPT = ROOT / ".ci" / "run"


def commands() -> list[list[str]]:
    """The words of each command of the script (continued lines joined, comments, leading
    variable assignments and what follows ``||`` dropped)."""
    text = CI_SCRIPT.read_text().replace("\\\n", " ")
    runs = []
    for line in text.splitlines():
        words = shlex.split(line.split("||")[0], comments=True)
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]
        if words:
            runs.append(words)
    return runs


def option_values(words: list[str], option: str) -> list[str]:
    return [words[i + 1].split("=", 1)[-1] for i, w in enumerate(words[:-1]) if w == option] + [
        w.split("=", 1)[1] for w in words if w.startswith(option + "=")]


def simulated_run() -> list[str]:
    runs = [r for r in commands() if r[:2] == ["python3", "scripts/gpu_runner.py"]]
    assert len(runs) == 1, commands()
    return runs[0]


def test_the_simulated_run_is_the_gpu_runners_own():
    run = simulated_run()
    assert "--simulated" in run, run
    assert not [c for c in commands() if "tests.simulated_sm90" in c], "a second launch path onto the simulated machine"
    command = build_pytest_command(Path("junit.xml"), [], simulated=True)
    assert "no:cacheprovider" in option_values(command, "-p") and "tests.simulated_sm90" in option_values(command, "-p")


def test_the_simulated_run_names_gpu_tier_files_flashmla_among_them():
    assert "tests/gpu/test_flashmla.py" in SIMULATED_FILES
    # the real kernels' own contracts: a stand-in cannot check them
    assert "tests/gpu/test_flashmla_contract.py" not in SIMULATED_FILES


def test_the_simulated_run_tests_the_wheel_ci_downloads():
    vllm_runs = [r for r in commands()
                 if r[:3] == ["python3", "-m", "pytest"] and option_values(r[3:], "-m") == ["vllm"]]
    assert len(vllm_runs) == 1, commands()
    wheel = option_values(vllm_runs[0], "--vllm")
    assert wheel and wheel == option_values(simulated_run(), "--vllm"), (wheel, simulated_run())
