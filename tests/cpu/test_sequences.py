"""A failure that needs several steps, handed on: a multi-step test under ``--dump-failures``
writes the sequence of its steps (``harness.port.sequence``, ``recording.sequence``), shrunk over
steps; ``--replay`` runs the sequence again with the state carried and fails where the bug is,
passes without it. The sequence file is checked field by field when it is loaded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fast.impl import FastImpl
from harness import batch
from harness.case_log import note_sequence, note_sequence_step
from harness.port.sequence import (
    ReusedBuffers,
    Sequence,
    first_failure,
    host_step_problems,
    run_host_sequence,
    shrink_sequence,
)
from recording.fixture import FixtureError
from recording.sequence import load_sequence, save_sequence, sequence_problem, sequence_recipe
from tests.bugs import PackedRewritesOnlyChangedRows

ROOT = Path(__file__).resolve().parents[2]
BUG = "--impl=tests.bugs:PackedRewritesOnlyChangedRows"


def run_pytest(pytester, *args: str):
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "--rootdir", str(ROOT), *args)


def decode_steps(count: int) -> Sequence:
    """Two requests past topk decoding: their rows keep their length while their slots move."""
    specs = [batch((300 + t, 1), (700 + t, 1), (40 + t, 1), topk=128) for t in range(count)]
    return Sequence("reused-buffers", "packed", tuple((s, i) for i, s in enumerate(specs)), max_rows=8)


def test_decode_steps_through_reused_buffers(impl, device):
    """Rows before and past topk decoding for four steps through buffers sized once and never
    cleared, every layout: each step plans each row's intended slots (a sequence test: under
    --dump-failures a failure is written as its steps)."""
    for layout in ("strided", "packed", "compacted"):
        sequence = dataclasses.replace(decode_steps(4), layout=layout)
        note_sequence(sequence.kind, layout, sequence.max_rows)
        buffers = ReusedBuffers(sequence.max_rows, sequence.width, device)
        for i, scenario in enumerate(sequence.scenarios()):
            note_sequence_step(scenario)
            problems = host_step_problems(impl, buffers, scenario, layout, where=f"step {i}")
            assert not problems, "\n".join(problems)


def test_the_sequence_bug_shows_only_with_carried_buffers(device):
    """Each step alone is right; carried from the step before, the rows past topk read the
    previous step's slots."""
    sequence = decode_steps(3)
    assert first_failure(run_host_sequence(FastImpl(), sequence, device)) is None
    failing = first_failure(run_host_sequence(PackedRewritesOnlyChangedRows(), sequence, device))
    assert failing is not None and failing.index == 1, failing
    assert "rows planned wrong [0, 1]" in failing.problems[0], failing.problems
    for i in range(3):
        alone = Sequence("reused-buffers", "packed", sequence.steps[i:i + 1], max_rows=8)
        assert first_failure(run_host_sequence(PackedRewritesOnlyChangedRows(), alone, device)) is None


def test_shrink_drops_the_steps_the_failure_does_not_need(device):
    sequence = decode_steps(4)
    # The failure needs the step before the last one only.
    last_two = sequence.steps[-2:]

    def fails(candidate):
        return first_failure(run_host_sequence(PackedRewritesOnlyChangedRows(), candidate, device)) is not None

    small, runs = shrink_sequence(sequence, fails)
    assert len(small.steps) == 2 and runs >= 2, (small.steps, runs)
    assert small.steps[-1] == last_two[-1]


def _saved(tmp_path, **changes) -> Path:
    recipe = sequence_recipe(decode_steps(2), name="s", failing_step=1, why="w")
    recipe.update(changes)
    return save_sequence(tmp_path / "s.sequence.json", recipe)


def _step(i, **changes):
    return lambda r: dict(r, steps=[dict(s, **changes) if j == i else s for j, s in enumerate(r["steps"])])


def _step_spec(i, **changes):
    return lambda r: dict(r, steps=[dict(s, spec=dict(s["spec"], **changes)) if j == i else s
                                    for j, s in enumerate(r["steps"])])


#: Each field of a sequence, a bad value and the line that refuses it.
BAD_FIELDS = {
    "max_rows-zero": (lambda r: dict(r, max_rows=0), "sequence field 'max_rows' is int 0, expected an int from 1 to "
                                                     "65536"),
    "max_rows-below-its-largest-step": (lambda r: dict(r, max_rows=2), "sequence field 'max_rows' is 2, expected at "
                                                                      "least the 3 rows of its largest step"),
    "kind": (lambda r: dict(r, kind="graph"), "sequence field 'kind' is str \"graph\", expected one of reused-buffers, "
                                              "attention-state"),
    "layout": (lambda r: dict(r, layout="diagonal"), "sequence field 'layout' is str \"diagonal\", expected one of "
                                                     "strided, packed, compacted"),
    "graph": (lambda r: dict(r, graph=1), "sequence field 'graph' is int 1, expected true or false"),
    "reuse_plan": (lambda r: dict(r, reuse_plan="no"), "sequence field 'reuse_plan' is str \"no\", expected true or "
                                                       "false"),
    "name": (lambda r: dict(r, name=1), "sequence field 'name' is int 1, expected a string"),
    "failing_step-past-the-steps": (lambda r: dict(r, failing_step=5), "sequence field 'failing_step' is 5, expected a "
                                                                       "step of the sequence (0 to 1)"),
    "failing_step-negative": (lambda r: dict(r, failing_step=-1), "sequence field 'failing_step' is int -1, expected "
                                                                  "an int from 0 to 255"),
    "why": (lambda r: dict(r, why=1), "sequence field 'why' is int 1, expected a string"),
    "impl": (lambda r: dict(r, impl="x"), "sequence field 'impl' is str \"x\", expected MODULE:FACTORY"),
    "vllm": (lambda r: dict(r, vllm=1), "sequence field 'vllm' is int 1, expected a string"),
    "nodeid": (lambda r: dict(r, nodeid=1), "sequence field 'nodeid' is int 1, expected a string"),
    "shrunk": (lambda r: dict(r, shrunk=[]), "sequence field 'shrunk' is list [], expected an object"),
    "unknown": (lambda r: dict(r, surprise=1), "sequence field 'surprise' is not a sequence field"),
    "steps-empty": (lambda r: dict(r, steps=[]), "sequence field 'steps' is not a list of 1 to 256 {spec, seed, "
                                                 "scenario_digest} objects"),
    "steps-past-their-bound": (lambda r: dict(r, steps=r["steps"] * 129),
                               "sequence field 'steps' is not a list of 1 to 256 {spec, seed, scenario_digest} objects "
                               "(it holds 258)"),
    "a-step-not-an-object": (lambda r: dict(r, steps=[1, 2]), "sequence field 'steps[0]' is not a {spec, seed, "
                                                             "scenario_digest} object"),
    "a-step-seed": (_step(1, seed=-1), "sequence field 'steps[1].seed' is int -1, expected an int from 0 to "
                                       "9223372036854775807"),
    "a-step-digest": (_step(0, scenario_digest="x"), "sequence field 'steps[0].scenario_digest' is str \"x\", expected "
                                                     "64 hexadecimal digits (a SHA-256)"),
    "a-step-topk-1e9": (_step_spec(1, topk=10**9), "sequence field 'steps[1].spec.topk' is int 1000000000, expected an "
                                                   "int from 1 to 2048"),
    "a-step-block-size-0": (_step_spec(1, block_size=0), "sequence field 'steps[1].spec.block_size' is int 0, expected "
                                                         "an int from 1 to 4096"),
}


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test where the scenario builder is called: a bad sequence stops before it."""
    import harness.builder
    import harness.scenario

    def refuse(*args, **kwargs):
        raise AssertionError("the scenario builder ran on a sequence that should have been refused")

    monkeypatch.setattr(harness.scenario, "build_scenario", refuse)
    monkeypatch.setattr(harness.builder, "build_scenario", refuse)


@pytest.fixture(scope="module")
def good_sequence() -> dict:
    """The JSON of a good two-step sequence (its scenarios built once, before any test refuses the builder)."""
    return json.loads(json.dumps(sequence_recipe(decode_steps(2), name="s", failing_step=1, why="w")))


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_bad_field_is_one_fixture_error_line_naming_it_and_nothing_is_built(tmp_path, good_sequence, nothing_built,
                                                                              case):
    change, line = BAD_FIELDS[case]
    path = save_sequence(tmp_path / "s.sequence.json", change(json.loads(json.dumps(good_sequence))))
    with pytest.raises(FixtureError) as info:
        load_sequence(path)
    assert str(info.value) == f"{path}: {line}"


def test_a_bad_step_and_an_edited_file_are_fixture_errors(tmp_path):
    recipe = json.loads(json.dumps(sequence_recipe(decode_steps(2), name="s", failing_step=1, why="w")))
    recipe["steps"][1]["spec"]["block_size"] = 0
    recipe["digest"] = "0" * 64
    assert sequence_problem(recipe) == ("sequence field 'steps[1].spec.block_size' is int 0, expected an int from 1 "
                                        "to 4096")
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    data["steps"][0]["seed"] = 9
    path.write_text(json.dumps(data))
    with pytest.raises(FixtureError, match="content digest"):
        load_sequence(path)


def test_a_step_whose_seed_was_edited_says_its_spec_or_seed_or_the_builder_changed(tmp_path):
    data = sequence_recipe(decode_steps(2), name="s", failing_step=1, why="w")
    data["steps"][0]["seed"] = 9  # another scenario than its digest names; the file's digest recomputed
    path = save_sequence(tmp_path / "t.sequence.json", data)
    with pytest.raises(FixtureError) as info:
        load_sequence(path)
    assert str(info.value) == (
        f"{path}: sequence field 'steps[0].scenario_digest' is not the digest of the scenario step 0's spec and seed "
        "build: the step's spec or seed was changed, or the scenario builder changed since the sequence was written")


@pytest.mark.suite_self_test
def test_cpu_journey_a_sequence_bug_dumps_replays_red_and_green_when_fixed(pytester, tmp_path):
    """The sequence test fails under the bug and writes one sequence file; its replay under the
    bug fails at the same step, and passes on the project's own implementation."""
    dump = tmp_path / "dumps"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_sequences.py"), BUG, "-k",
                        "test_decode_steps_through_reused_buffers", f"--dump-failures={dump}")
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, output[-3000:]
    written = sorted(dump.glob("*.sequence.json"))
    assert len(written) == 1 and not list(dump.glob("*.safetensors")), output[-3000:]
    replay_line = next(line for line in result.outlines if line.startswith("replay: "))
    assert replay_line == f"replay: pytest --replay={written[0]} --impl tests.bugs:PackedRewritesOnlyChangedRows"
    recipe = json.loads(written[0].read_text())
    assert recipe["impl"] == "tests.bugs:PackedRewritesOnlyChangedRows" and recipe["kind"] == "reused-buffers"
    assert len(recipe["steps"]) >= 2 and "carried from step to step" in recipe["why"]
    red = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={written[0]}", BUG)
    red_text = "\n".join(red.outlines)
    assert red.ret == 1 and f"step {recipe['failing_step']} of the sequence fails" in red_text, red_text[-3000:]
    green = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={written[0]}")
    assert green.ret == 0, "\n".join(green.outlines)[-3000:]


def test_a_sequence_that_fails_at_its_first_step_is_written_as_that_step(pytester, tmp_path):
    """A bug every step shows fails a host-stage sequence at its first step, which notes no case
    of its own: the dump is the one-step sequence, which replays red under the bug and green on
    the project's own implementation."""
    dump = tmp_path / "dumps"
    bug = "--impl=tests.bugs:ContextIsPosition"
    result = run_pytest(pytester, str(ROOT / "tests/cpu/test_sequences.py"), bug, "-k",
                        "test_decode_steps_through_reused_buffers", f"--dump-failures={dump}")
    output = "\n".join(result.outlines + result.errlines)
    written = sorted(dump.glob("*.sequence.json"))
    assert result.ret == 1 and len(written) == 1 and "nothing written" not in output, output[-3000:]
    recipe = json.loads(written[0].read_text())
    assert recipe["failing_step"] == 0 and len(recipe["steps"]) == 1, recipe
    red = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={written[0]}", bug)
    assert red.ret == 1 and "step 0 of the sequence fails" in "\n".join(red.outlines), "\n".join(red.outlines)[-3000:]
    green = run_pytest(pytester, str(ROOT / "tests/test_replay.py"), f"--replay={written[0]}")
    assert green.ret == 0, "\n".join(green.outlines)[-3000:]


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
def test_gpu_journey_a_stateful_bug_dumps_a_sequence_that_replays_red_and_green_on_a_simulated_machine(
    pytester, monkeypatch, tmp_path
):
    """An attention state that keeps stale lengths after a smaller replan fails the stale-slots
    family; its dump is the sequence of steps through one attention state, which replays red
    under the bug and green on the project's own path (on a simulated SM90 machine: FlashInfer's
    wrapper replaced by the reference)."""
    from tests.support.child_runs import run_gpu_family

    dump = tmp_path / "dumps"
    bug = "--impl=tests.bugs:StaleLengthsPastTheRowCount"
    result = run_gpu_family(pytester, monkeypatch, "tests/gpu/test_edges.py",
                            "test_previous_steps_slots_change_nothing and packed-short", bug,
                            f"--dump-failures={dump}", simulated=True)
    output = "\n".join(result.outlines + result.errlines)
    assert result.ret == 1, output[-3000:]
    written = sorted(dump.glob("*.sequence.json"))
    assert len(written) == 1, (sorted(p.name for p in dump.iterdir()) if dump.exists() else [], output[-3000:])
    recipe = json.loads(written[0].read_text())
    assert recipe["kind"] == "attention-state" and recipe["reuse_plan"] and len(recipe["steps"]) >= 2, recipe
    red = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={written[0]}", bug,
                         simulated=True)
    red_text = "\n".join(red.outlines + red.errlines)
    assert red.ret == 1 and "stale kv_len past row" in red_text, red_text[-3000:]
    green = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={written[0]}",
                           simulated=True)
    assert green.ret == 0, "\n".join(green.outlines + green.errlines)[-3000:]


@pytest.mark.gpu_stand_in
@pytest.mark.suite_self_test
def test_gpu_journey_a_graph_captured_sequence_replays_red_under_its_bug_and_green_without_on_a_simulated_machine(
    pytester, monkeypatch, tmp_path
):
    """A CUDA graph captured after a plan of 25 rows of 128 heads (cluster size 2) and replayed
    after a plan of 3 rows (cluster size 1) on a state that kept the larger plan's lengths: the
    graph test fails under the bug and writes the two-step graph sequence, capture step first.
    Its replay fails under the bug and passes without it: there the replay shows FlashInfer's
    standing finding (the simulated machine's graphs keep the captured cluster size, leaving a
    tile of the smaller plan unwritten), which the replay judges as the test does, against an
    eager run of the same plan, and reports without failing."""
    from harness.findings import STALE_CLUSTER_FINDING
    from tests.support.child_runs import run_gpu_family

    dump = tmp_path / "dumps"
    bug = "--impl=tests.bugs:StaleLengthsPastTheRowCount"
    result = run_gpu_family(pytester, monkeypatch, "tests/gpu/test_cuda_graphs.py", "h128", bug,
                            f"--dump-failures={dump}", simulated=True)
    output = "\n".join(result.outlines + result.errlines)
    written = sorted(dump.glob("*.sequence.json"))
    assert result.ret == 1 and len(written) == 1, output[-3000:]
    recipe = json.loads(written[0].read_text())
    assert recipe["graph"] and recipe["max_rows"] == 25 and len(recipe["steps"]) == 2, recipe
    assert recipe["failing_step"] == 1 and recipe["steps"][0]["seed"] == 21, recipe
    red = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={written[0]}", bug,
                         simulated=True)
    red_text = "\n".join(red.outlines + red.errlines)
    assert red.ret == 1 and "stale kv_len past row 3" in red_text, red_text[-3000:]
    green = run_gpu_family(pytester, monkeypatch, "tests/test_replay.py", "", f"--replay={written[0]}",
                           simulated=True)
    green_text = "\n".join(green.outlines + green.errlines)
    assert green.ret == 0, green_text[-3000:]
    assert "step 1 shows a known finding, not failed: graph replay != eager run of the same plan on rows [2]" \
           in green_text and STALE_CLUSTER_FINDING in green_text, green_text[-3000:]


def test_a_graph_replay_may_differ_from_the_eager_run_only_where_the_cluster_size_changed():
    """As tests/gpu/test_cuda_graphs.py judges a replay: equal to the eager run of the same plan,
    or different where the plan's cluster size is not the captured one (a finding, not a
    failure); a difference at the captured cluster size is a problem."""
    from harness.findings import STALE_CLUSTER_FINDING
    from harness.port.sequence import replay_against_eager

    assert replay_against_eager([], 3, 25, 128, 25) == ([], [])
    problems, findings = replay_against_eager([2], 3, 25, 128, 25)  # cluster size 1, captured 2
    assert not problems and len(findings) == 1 and findings[0].endswith(STALE_CLUSTER_FINDING), findings
    problems, findings = replay_against_eager([0, 1], 3, 25, 64, 25)  # cluster size 1 both
    assert not findings and problems == ["graph replay != eager run of the same plan on rows [0, 1] (3 rows, "
                                         "cluster size 1; captured after 25 rows, cluster size 1)"], problems


def test_the_harness_cluster_size_rule_is_the_ports():
    from backends.flashinfer.compat import fa3_mla_cluster_size
    from harness.plan_limits.scheduler import cluster_size

    for rows, heads, size in [(25, 128, 25), (3, 128, 25), (25, 64, 25), (1, 65, 1), (0, 128, 0), (12, 128, 25)]:
        assert cluster_size(rows, heads, size) == fa3_mla_cluster_size(rows, heads, size), (rows, heads, size)


def test_the_shrink_keeps_a_graph_sequences_capture_step(device):
    """A graph sequence's first step is the batch its test captured the graph after: a shrink
    never drops it, even where the failure shows without it."""
    sequence = dataclasses.replace(decode_steps(3), kind="attention-state", graph=True)
    small, runs = shrink_sequence(sequence, lambda candidate: True)
    assert small.steps == (sequence.steps[0], sequence.steps[2]) and runs == 1, (small.steps, runs)
    plain, _ = shrink_sequence(dataclasses.replace(sequence, graph=False), lambda candidate: True)
    assert plain.steps == sequence.steps[2:]


class RaisesOnTheSecondStep(FastImpl):
    def __init__(self):
        self.calls = 0

    def kv_lens(self, meta, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise ValueError("refused at step 1")
        return super().kv_lens(meta, **kwargs)


def test_a_step_that_raises_fails_that_step_and_ends_the_run(device):
    """An exception in a step (the implementation's, or a vendor refusing what it was handed) is
    that step's failure, named, so a sequence that dies that way is still written and replayed."""
    results = run_host_sequence(RaisesOnTheSecondStep(), decode_steps(3), device)
    assert [r.index for r in results] == [0, 1] and not results[0].problems
    assert results[1].problems == ["step 1 raised ValueError: refused at step 1"]
