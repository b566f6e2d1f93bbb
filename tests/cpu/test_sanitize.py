"""scripts/sanitize.py without a GPU: where compute-sanitizer is looked for, its log parsed (both
location formats, API errors apart, a run that did not finish), what counts as a problem, the
report, and the driver's case through the CPU stand-in of the wrapper."""

from __future__ import annotations

import os
import stat

import pytest

import harness.port.launch
import scripts.sanitize as sanitize

#: A kernel frame and an API error as compute-sanitizer writes them, each one line of the log.
HOPPER_FRAME = (
    "=========     at void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<Params>(Params)+0x1a40"
    " in mla_hopper.cuh:412"
)
LAUNCH_FAILURE = (
    '========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure"'
    " on CUDA API call to cudaStreamSynchronize."
)
MEMCHECK_LOG = f"""========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
{HOPPER_FRAME}
=========     by thread (96,0,0) in block (3,0,0)
=========     Address 0x7f12a0001000 is out of bounds
=========     and is 4096 bytes after the nearest allocation at 0x7f12a0000000 of size 4096 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2d3f1f] in libcuda.so.1
=========
========= Invalid __global__ read of size 16 bytes
{HOPPER_FRAME}
=========     by thread (97,0,0) in block (3,0,0)
=========
{LAUNCH_FAILURE}
=========     Saved host backtrace up to driver entry point at error
=========
========= ERROR SUMMARY: 3 errors
"""

INITCHECK_OLD_FORMAT = """========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x00000290 in /tmp/jit/batch_mla_sm90_run.cu:88:merge_kernel(float*, int)
=========     by thread (0,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 1 error
"""


def test_memcheck_log_errors_by_kind_and_kernel_api_errors_apart():
    parsed = sanitize.parse_log(MEMCHECK_LOG)
    assert parsed["summary"] == 3
    kernel = "void flashinfer::mla::hopper::BatchMLAPageAttentionHopperKernel<Params>(Params)"
    assert parsed["errors"] == {f"Invalid __global__ read | {kernel}": 2}
    assert parsed["api_errors"] == {"cudaErrorLaunchFailure (unspecified launch failure) at cudaStreamSynchronize": 1}
    assert parsed["headlines"][0] == "Invalid __global__ read of size 16 bytes" and len(parsed["headlines"]) == 3


def test_older_location_format_names_the_kernel():
    parsed = sanitize.parse_log(INITCHECK_OLD_FORMAT)
    assert parsed == {"summary": 1, "errors": {"Uninitialized __global__ memory read | merge_kernel(float*, int)": 1},
                      "api_errors": {}, "headlines": ["Uninitialized __global__ memory read of size 4 bytes"]}


def test_a_clean_log_and_an_unfinished_one():
    assert sanitize.parse_log("========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n")["summary"] == 0
    assert sanitize.parse_log("========= COMPUTE-SANITIZER\nsome program output\n")["summary"] is None


def run(summary, errors=None, driver=None, tool="memcheck"):
    return {"tool": tool, "variant": "bf16-rope64", "summary": summary, "errors": errors or {}, "api_errors": {},
            "driver": driver, "returncode": 0, "seconds": 12.5, "stderr_tail": "Killed"}


def test_problems_are_errors_unfinished_runs_and_rows_not_finite():
    clean = {"variant": "bf16-rope64", "nonfinite_rows": [], "flashinfer": "0.7.4"}
    assert sanitize.run_problems(run(0, driver=clean)) == []
    assert (
        "2 errors: Invalid __global__ read | k x2"
        in sanitize.run_problems(run(2, {"Invalid __global__ read | k": 2}, clean))[0]
    )
    assert sanitize.run_problems(run(None, driver=None))[0].startswith("memcheck bf16-rope64: no error summary")
    assert "the driver did not finish" in sanitize.run_problems(run(0, driver=None))[0]
    assert "rows [1] not finite" in sanitize.run_problems(run(0, driver=dict(clean, nonfinite_rows=[1])))[0]


def test_report_has_a_line_per_run():
    clean = {"variant": "bf16-rope64", "nonfinite_rows": [], "flashinfer": "0.7.4"}
    text = sanitize.report_markdown("/usr/local/cuda/bin/compute-sanitizer",
                                    [run(0, driver=clean), run(1, {"Uninitialized | k": 1}, clean, tool="initcheck")])
    assert "FlashInfer 0.7.4" in text and "| memcheck | bf16-rope64 | 0 | - | - | [] | 12.5 |" in text
    assert "| initcheck | bf16-rope64 | 1 | Uninitialized / k x1 |" in text


def test_sanitizer_is_found_on_path_first(tmp_path, monkeypatch):
    tool = tmp_path / "compute-sanitizer"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    assert sanitize.find_sanitizer() == str(tool)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sanitize.glob, "glob", lambda pattern: [])
    assert sanitize.find_sanitizer() is None
    assert sanitize.not_found_reason().startswith("compute-sanitizer not found (looked on PATH, /usr/local/cuda*/bin")


def test_every_variant_has_a_driver_config():
    assert sorted(sanitize.kernel_configs()) == ["bf16-nope", "bf16-rope64", "fp8-rope64"]


@pytest.mark.parametrize("variant", ["bf16-rope64", "fp8-rope64", "bf16-nope"])
def test_driver_runs_its_case_through_the_stand_in(stand_in, device, monkeypatch, variant):
    monkeypatch.setattr(harness.port.launch, "DEVICE", device.type)
    result = sanitize.driver(variant, device.type)
    assert result["regimes"] == ["G", "C", "D"] and result["rows"] == 3 and result["nonfinite_rows"] == []


def test_main_without_a_sanitizer_says_where_it_looked(monkeypatch, capsys):
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: None)
    assert sanitize.main([]) == 2
    assert "compute-sanitizer not found" in capsys.readouterr().out
