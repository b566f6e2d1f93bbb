"""The fixture of the differential case a failing test was checking (``--dump-failures``).

The shared helpers note the case under check in :mod:`harness.case_log`; this module opens the
log for a running test (:func:`logging_cases`) and builds the fixture of the last noted case
(:meth:`CaseLog.build`), or of any prepared step (:func:`fixture_from_step`), or of some rows of
a step too large to build whole (:func:`fixture_of_rows`).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager

import torch

from harness import case_log as notes
from harness.case_log import note_crash as note_crash  # re-exported: the helpers' noting API
from harness.case_log import note_fixture as note_fixture
from harness.case_log import note_step as note_step
from harness.pipeline import Step
from harness.scenario import build_attention_inputs

from .environment import flashinfer_version
from .fixture import Fixture, build_fixture, subset_fixture


class CaseLog(notes.CaseLog):
    def build(self, **meta) -> Fixture | None:
        """The fixture of the last noted case (inputs rebuilt on the host when no compare saw
        them), with ``meta`` added; None when nothing was noted."""
        if self.fixture is not None:
            fx = self.fixture
            fx.meta.update({k: v for k, v in meta.items() if k not in fx.meta})
            return fx
        if self.step is None:
            return None  # a crash is written as a recipe (recording.dump.write_crash)
        step = self.step
        inputs = self.inputs if self.inputs is not None else build_attention_inputs(step.scenario)
        n = step.num_planned
        installed = flashinfer_version() or "kernel"
        outputs = {installed if v == "kernel" else v: (out[:n].detach().cpu(), lse[:n].detach().float().cpu())
                   for v, (out, lse) in self.outputs.items()}
        return fixture_from_step(step, inputs, outputs=outputs, **meta)


def logging_cases() -> AbstractContextManager[CaseLog]:
    """Keep the cases noted inside the block in the yielded :class:`CaseLog`."""
    return notes.logging_cases(CaseLog())


def fixture_from_step(step: Step, inputs, outputs=None, **meta) -> Fixture:
    """A replayable fixture of the step's planned rows (only the referenced KV slots kept)."""
    sc, spec = step.scenario, step.scenario.spec
    n = step.num_planned
    base = dict(
        name=meta.pop("name", None),
        spec=dataclasses.asdict(spec),
        seed=sc.seed,
        layout=step.layout,
        sm_scale=spec.sm_scale,
        k_scale=spec.k_scale,
        kv_dtype=spec.kv_dtype,
        page_size=1,
        causal=False,
        regimes=sc.row_regime[:n],
        row_ctx=sc.row_ctx[:n].tolist(),
        max_rows=step.max_rows,
    )
    base.update(meta)
    return build_fixture(
        meta=base,
        q_nope=inputs.q_nope[:n],
        q_pe=inputs.q_pe[:n],
        ckv=inputs.ckv,
        kpe=inputs.kpe,
        kv_indptr=step.kv_indptr[: n + 1],
        kv_indices=step.kv_indices,
        kv_len=step.planned_lens,
        intended=sc.intended_slots()[:n],
        outputs=outputs,
    )


def plan_failing_rows(step: Step) -> list[int]:
    """The planned rows whose plan is wrong: an invariant broken on the row, or its planned
    selection (b) other than the intended one (a), compared on the device the step ran on (the
    host's reference functions give the same rows, but take tens of seconds at 10^4 rows)."""
    from harness.row_check import selection_mismatches_on

    n = step.num_planned
    rows = {v.row for v in step.violations if v.row is not None and v.row < n}
    rows.update(r for r in selection_mismatches_on(step, step.kv_indices.device) if r < n)
    return sorted(rows)


#: Where :func:`fixture_of_rows` draws q: each row from its own key, as the scale cases draw it
#: (:func:`harness.scenario.build_attention_inputs_on`).
ROW_Q_COMPONENT = "q-rows"


def fixture_of_rows(step: Step, rows: list[int], **meta) -> Fixture | None:
    """A fixture of some planned rows of ``step``, built without the batch's q and KV cache: q
    of each row drawn from its key (:data:`ROW_Q_COMPONENT`), the KV slots the rows' plan and
    intended selection read from the scenario's hash (NaN where no row of the batch should read
    the slot, as the poisoned cache holds), and the step's plan of those rows. For a failing
    batch too large to build (tens of thousands of rows), whose failure is in the plan. None
    where the scenario carries score offsets (written into q and the cache together)."""
    from harness.device_inputs import nan_kv_buffer, readable_slots_on
    from harness.scenario import component_seed, query_rows, slot_values
    from mla_constants import KV_LORA_RANK
    from reference.rules import convert_rule


    sc, spec = step.scenario, step.scenario.spec
    if spec.score_offsets:
        return None
    n = step.num_planned
    rows = sorted({int(r) for r in rows if 0 <= int(r) < n})
    r = torch.tensor(rows, dtype=torch.int64)
    indptr, lens = step.kv_indptr.to(torch.int64).cpu(), step.planned_lens.to(torch.int64).cpu()
    spans = [step.kv_indices[int(indptr[i]) : int(indptr[i] + lens[i])].cpu().to(torch.int64) for i in rows]
    intended = convert_rule(sc.topk_indices[r], sc.block_table, sc.request_ids()[r], spec.block_size).to(torch.int64)
    used = torch.cat([*spans, intended.flatten()]) if rows else torch.zeros(0, dtype=torch.int64)
    ids = torch.unique(used[used >= 0])
    values = torch.from_numpy(slot_values(component_seed(sc.seed, "kv"), ids.numpy(), spec.head_dim))
    readable = readable_slots_on(sc, step.kv_indices.device).cpu()  # every row's, on the step's device
    cache = values.to(spec.torch_kv_dtype)
    poisoned = ~torch.isin(ids, readable)
    cache[poisoned] = nan_kv_buffer((int(poisoned.sum()), spec.head_dim), spec.kv_dtype, "cpu")
    local = lambda t: torch.where(t >= 0, torch.searchsorted(ids, t.clamp(min=0)), -1)  # noqa: E731
    q = query_rows(component_seed(sc.seed, ROW_Q_COMPONENT), r, spec.num_heads, spec.head_dim, "cpu")
    packed = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens[r], 0)])
    base = dict(
        name=meta.pop("name", None), spec=dataclasses.asdict(spec), seed=sc.seed, layout=step.layout,
        sm_scale=spec.sm_scale, k_scale=spec.k_scale, kv_dtype=spec.kv_dtype, page_size=1, causal=False,
        regimes=[sc.row_regime[i] for i in rows], row_ctx=[int(sc.row_ctx[i]) for i in rows], max_rows=len(rows),
        rows=rows,
    )
    base.update(meta)
    fx = build_fixture(
        meta=base, q_nope=q[..., :KV_LORA_RANK], q_pe=q[..., KV_LORA_RANK:], ckv=cache[:, :KV_LORA_RANK],
        kpe=cache[:, KV_LORA_RANK:], kv_indptr=packed,
        kv_indices=local(torch.cat(spans)) if spans else torch.zeros(0, dtype=torch.int64),
        kv_len=lens[r], intended=local(intended),
    )
    fx.tensors["slot_ids"] = ids[fx.tensors["slot_ids"]]  # the batch's slot ids
    fx.meta["num_slots_original"] = sc.num_slots
    return subset_fixture(fx, list(range(len(rows)))) if step.layout == "strided" else fx
