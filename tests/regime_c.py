"""The regime C finding (docs/findings.md#regime-c-planned-as-a-prefix) as both tiers hold it: the
cases of every context regime and batch situation that the CPU tier (kv_len, plans) and the GPU
tier (the kernel) run under every layout, the strict xfail those of them with regime C rows carry
under the layouts that plan such rows as a prefix, and the check that raises the finding before
launch."""

from __future__ import annotations

import pytest

from harness.cases import all_regime_cases, has_regime_c, situation_cases
from harness.findings import REGIME_C_FINDING, RegimeCPlannedAsPrefix, regime_c_finding

#: Every context regime (kpool 1 and 4) and every batch situation.
REGIME_CASES = all_regime_cases() + situation_cases(1) + situation_cases(4)


def regime_c_marks(case, layout: str) -> list:
    """The finding's strict xfail where ``case`` plans regime C rows under a layout other than
    compacted; it expects :class:`RegimeCPlannedAsPrefix` and nothing else."""
    if not has_regime_c(case) or layout == "compacted":
        return []
    return [pytest.mark.xfail(reason=REGIME_C_FINDING.format(layout=layout), raises=RegimeCPlannedAsPrefix,
                              strict=True)]


def raise_regime_c_finding(step, regime_log, note: str = "") -> None:
    """Raise the finding, blamed on regime C, where the step shows it and nothing else."""
    finding = regime_c_finding(step)
    if finding:
        regime_log.blame(["C"])
        raise RegimeCPlannedAsPrefix(finding + note)
