"""Replay of recorded fixtures: the checked-in ``fixtures/`` folder by default, or the files
and folders given with ``--replay``. Each fixture's recorded FlashInfer outputs are checked
against the reference over the planned slots (b) within the error budget, and the plan
against the intended selection (a); a fixture recorded from a known finding declares it
(``expect_finding``) and must still show it."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from pytest_sparse_mla.keys import REPLAY_KEY
from recording.fixture import FixtureError, fixture_paths, load_fixture
from recording.replay import replay

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FIXTURES = ROOT / "fixtures"


def pytest_generate_tests(metafunc):
    if "fixture_path" not in metafunc.fixturenames:
        return
    given = metafunc.config.getoption("--replay")
    paths = fixture_paths(given or [DEFAULT_FIXTURES])
    if not paths:
        where = ", ".join(given) if given else str(DEFAULT_FIXTURES)
        metafunc.parametrize("fixture_path", [pytest.param(None, marks=pytest.mark.skip(reason=f"no fixture files under {where}"))])
        return
    ids = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in paths]
    metafunc.parametrize("fixture_path", paths, ids=ids)


def reproduce_command(path: Path) -> str:
    return f"pytest --replay={shlex.quote(str(path))} -p no:xdist -rA"


@pytest.mark.replay
def test_replay_fixture(fixture_path, request, regime_log):
    try:
        fx = load_fixture(fixture_path)
    except FixtureError as exc:
        pytest.fail(str(exc), pytrace=False)
    report = replay(fx)
    regime_log.record(report.regimes, focus=fx.meta.get("focus") or None)
    text = report.render(reproduce_command(fixture_path))
    request.node.user_properties.append((REPLAY_KEY, text))
    if request.config.getoption("--replay"):
        write_heatmaps(report)
    assert report.kernel_ok, f"kernel != as-planned reference beyond the error budget\n{text}"
    finding = fx.meta.get("expect_finding")
    if finding:
        regime_log.blame(report.regimes[r] for r in report.plan_mismatch_rows)
        assert not report.plan_ok, f"the recorded finding no longer shows ({finding}); update the fixture\n{text}"
    else:
        assert report.plan_ok, f"plan != intent\n{text}"


def write_heatmaps(report) -> list[Path]:
    """Per recorded version, a PNG of the max abs error per (row, head) beside the fixture."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from recording.replay import reference_outputs

    fx = report.fixture
    truth, _ = reference_outputs(fx, "planned", "float64")
    written = []
    for version, (out, _) in fx.outputs.items():
        err = (out.double() - truth).abs().amax(dim=-1).nan_to_num(nan=float("inf"))
        fig, ax = plt.subplots(figsize=(6, 4))
        im = ax.imshow(err.T.numpy(), aspect="auto", interpolation="nearest", cmap="magma")
        ax.set_xlabel("row")
        ax.set_ylabel("head")
        ax.set_title(f"{fx.name} [{version}] max |out - ref(b)|")
        fig.colorbar(im, ax=ax)
        path = fx.path.with_name(f"{fx.path.stem}.{version}.err.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
