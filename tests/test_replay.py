"""Replay of recorded fixtures: the checked-in ``fixtures/`` folder by default, or the files
and folders given with ``--replay`` (or, under the upgrade check, ``--baseline-fixtures``).
Each fixture's recorded FlashInfer outputs are checked against the reference over the
planned slots (b) within the error budget, and the plan against the intended selection (a);
a fixture recorded from a known finding declares it (``expect_finding``) and must still show it.
On an SM90 GPU with FlashInfer each fixture is also re-run on the installed FlashInfer
(recording.rerun) unless ``--replay-recorded-only``; elsewhere its host stages are re-run
through the implementation under test (recording.restage) and the plan is judged on what it
plans now. A recipe (``*.recipe.json``) is rebuilt from its spec and seed through the
implementation under test (its stages in a child process where they once killed theirs).
A replay of no fixture fails (docs/replay.md).
With ``--replay`` the error heatmaps of a failing fixture (of every fixture with
``--replay-heatmaps``) are written after the verdict, which they never change.
Under ``--record-baseline`` / ``--compare-baseline`` each re-run is recorded for the upgrade
check (pytest_sparse_mla.baselines.note_fixture_replay)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_sparse_mla import replay as replay_plugin
from pytest_sparse_mla.baselines import upgrade_check_fixtures
from pytest_sparse_mla.replay_case import replay_written_case
from recording.fixture import fixture_paths

ROOT = Path(__file__).resolve().parents[1]


def pytest_generate_tests(metafunc):
    if "fixture_path" not in metafunc.fixturenames:
        return
    given = metafunc.config.getoption("--replay") or upgrade_check_fixtures(metafunc.config)
    paths = fixture_paths(given or [replay_plugin.DEFAULT_FIXTURES])
    if not paths:  # a replay of nothing fails: a vanished fixtures/ must not leave CI green
        where = ", ".join(given) if given else str(replay_plugin.DEFAULT_FIXTURES)
        metafunc.parametrize("fixture_path", [pytest.param(f"no fixture files under {where}", id="no-fixtures")])
        return
    ids = [str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p) for p in paths]
    metafunc.parametrize("fixture_path", paths, ids=ids)


@pytest.mark.replay
def test_replay_fixture(fixture_path, request, regime_log):
    if isinstance(fixture_path, str):
        pytest.fail(fixture_path, pytrace=False)
    replay_written_case(fixture_path, request, regime_log)
