"""The upgrade check's records read back field by field: a record, a timing file or an outputs
file that is wrong is one BaselineError line naming the file and the field (the plugin reports it
as a usage error before any test runs), never a comparison of what it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recording.baseline.records import (
    RERECORD,
    BaselineError,
    CaseRecord,
    check_baseline,
    read_record,
    read_timing,
    record_json,
    write_record,
)

CASE = "tests/gpu/test_x.py::test_case[a]"


def written(tmp_path: Path, **changes) -> Path:
    """A good record of CASE with ``changes`` made to its JSON."""
    data = json.loads(record_json(CaseRecord(case=CASE, flashinfer="0.7.4", ratios={"out_max_ratio": 0.4},
                                             kernel_us_repeats=[70.0, 70.5, 69.9], plan_us_repeats=[150.0]))) | changes
    path = tmp_path / "test_case_a_.json"
    path.write_text(json.dumps(data))
    return path


#: Each field of a record, a bad value and the line that refuses it.
RECORD_FIELDS = {
    "case-empty": (dict(case=""), "record field 'case' is str \"\", expected a test id"),
    "outcome-unknown": (dict(outcome="maybe"), "record field 'outcome' is str \"maybe\", expected one of passed, "
                                               "failed, skipped, xfailed, xpassed, error"),
    "flashinfer-as-number": (dict(flashinfer=7), "record field 'flashinfer' is int 7, expected null or a string"),
    "error-as-list": (dict(error=["x"]), "record field 'error' is list [\"x\"], expected null or a string"),
    "warnings-not-text": (dict(warnings=[1]), "record field 'warnings' is list [1], expected a list of at most 10000 "
                                              "strings"),
    "ratio-negative": (dict(ratios={"out_max_ratio": -1.0}), "record field 'ratios' is dict {\"out_max_ratio\": "
                                                             "-1.0}, expected an object of error-budget ratios, "
                                                             "numbers >= 0 (inf where the yardstick has no error)"),
    "ratio-nan": (dict(ratios={"out_max_ratio": float("nan")}), "record field 'ratios' is dict {\"out_max_ratio\": "
                                                                "NaN}, expected an object of error-budget ratios, "
                                                                "numbers >= 0 (inf where the yardstick has no error)"),
    "kernel-time-zero": (dict(kernel_us_repeats=[0.0]), "record field 'kernel_us_repeats' is list [0.0], expected a "
                                                        "list of at most 1000 finite times > 0 (us)"),
    "plan-time-infinite": (dict(plan_us_repeats=[float("inf")]), "record field 'plan_us_repeats' is list [Infinity], "
                                                                 "expected a list of at most 1000 finite times > 0 "
                                                                 "(us)"),
    "fixture-as-number": (dict(fixture=3), "record field 'fixture' is int 3, expected null or a string"),
}


@pytest.mark.parametrize("case", sorted(RECORD_FIELDS))
def test_each_record_field_is_one_line_naming_it(tmp_path, case):
    changes, line = RECORD_FIELDS[case]
    path = written(tmp_path, **changes)
    with pytest.raises(BaselineError) as info:
        read_record(path)
    assert str(info.value) == f"{path}: {line}; {RERECORD}"


def test_a_good_record_reads_back_and_an_infinite_ratio_is_one(tmp_path):
    record = read_record(written(tmp_path, ratios={"out_max_ratio": float("inf")}))
    assert record.case == CASE and record.ratios == {"out_max_ratio": float("inf")}


def test_a_bad_record_in_a_baseline_folder_is_refused_at_its_check(tmp_path):
    path = written(tmp_path, outcome="maybe")
    with pytest.raises(BaselineError, match=r"test_case_a_\.json: record field 'outcome' is str \"maybe\""):
        check_baseline(tmp_path)
    assert path.exists()


@pytest.mark.parametrize(("data", "line"), [
    ({"kernel_us_repeats": [1.0]}, "timing field 'case' is missing"),
    ({"case": CASE, "kernel_us_repeats": [-1.0]}, "timing field 'kernel_us_repeats' is list [-1.0], expected a list "
                                                  "of at most 1000 finite times > 0 (us)"),
    ({"case": CASE, "colour": 1}, "timing field 'colour' is not a timing field"),
    ([1], "not a timing file (a JSON list)"),
])
def test_each_timing_field_is_one_line_naming_it(tmp_path, data, line):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(BaselineError) as info:
        read_timing(path)
    assert str(info.value) == f"{path}: {line}"


def test_outputs_past_their_count_are_refused(tmp_path, monkeypatch):
    from recording.baseline import records

    write_record(tmp_path, CaseRecord(case=CASE), {"out": torch.zeros(2), "lse": torch.zeros(2)})
    monkeypatch.setattr(records, "MAX_OUTPUTS", 1)
    with pytest.raises(BaselineError) as info:
        check_baseline(tmp_path)
    outputs = tmp_path / "test_case_a_.safetensors"
    assert str(info.value) == f"{outputs}: 2 output tensors, expected at most 1; {RERECORD}"
