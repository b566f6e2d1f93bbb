"""The one scenario builder every tier uses: a batch spec + a seed -> a step's host tensors.

From a :class:`harness.spec.BatchSpec` and a seed, :func:`build_scenario` derives everything
on the host: the block table (permuted physical blocks, physical block 0 never allocated, a
table wider than any allocation with stale entries past each allocation), the indexer rows,
the metadata the production builder reads (as vLLM's model runner fills it, a FULL CUDA graph's
padding included), and each row's context and regime. Every random
draw comes from a NumPy generator keyed by ``(seed, component)``
(:func:`harness.hashed_values.component_seed`), so the same spec and seed give the same
tensors on any machine.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from mla_constants import NULL_BLOCK_ID
from reference.indexer import decode_rows_use_identity, prefill_rows_use_identity
from reference.rules import classify_rows, route_prefills_to_mha, row_context

from .hashed_values import component_seed
from .indexer_fill import indexer_rows_fast
from .spec import BatchSpec, Scenario, StepMetadata


def _allocate_blocks(spec: BatchSpec, rng: np.random.Generator) -> tuple[list[np.ndarray], int]:
    needed = [math.ceil(r.seq_len / spec.block_size) for r in spec.requests]
    total = sum(needed)
    num_blocks = spec.min_block_id + total + spec.spare_blocks
    pool = spec.min_block_id + rng.permutation(total + spec.spare_blocks)
    bounds = np.cumsum([0] + needed)
    return [pool[bounds[i] : bounds[i + 1]] for i in range(len(needed))], num_blocks


def _block_table(allocs: list[np.ndarray], table_width: int, num_blocks: int, rng) -> np.ndarray:
    """Allocated blocks first, then stale ids (anything but block 0) up to the table width."""
    table = rng.integers(1, num_blocks, size=(len(allocs), table_width), dtype=np.int64)
    for i, blocks in enumerate(allocs):
        table[i, : blocks.size] = blocks
    return table.astype(np.int32)


def leading_decodes(spec: BatchSpec) -> int:
    """How many requests the engine counts as decodes: those before the first request with more
    than ``decode_threshold`` query rows (a request with no query row counts as a decode there,
    as a prefill after it)."""
    for i, r in enumerate(spec.requests):
        if r.q_len > spec.decode_threshold:
            return i
    return len(spec.requests)


@dataclass(frozen=True)
class RowPlan:
    """What a spec alone decides of each query row, before any random draw: its context, whether
    the indexer gives it the identity row, its regime, and which rows the sparse kernel plans."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    ctx: torch.Tensor
    identity: torch.Tensor
    regime: list[str]
    prefills_to_mha: bool

    @property
    def planned_rows(self) -> int:
        """Rows handed to the sparse kernel: the decode prefix when prefills go to MHA."""
        return self.num_decode_tokens if self.prefills_to_mha else int(self.ctx.numel())

    @property
    def planned_regimes(self) -> list[str]:
        """The regime of each planned row."""
        return self.regime[: self.planned_rows]


def plan_rows(spec: BatchSpec) -> RowPlan:
    """Each row's context, identity, regime and the planned rows of ``spec``: no block table,
    no indexer draw, no tensor wider than the batch."""
    reqs = spec.requests
    seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    q_lens = torch.tensor([r.q_len for r in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    num_rows = int(qsl[-1])
    num_decodes = leading_decodes(spec)
    num_decode_tokens = int(qsl[num_decodes])

    ctx = row_context(seq_lens, qsl)
    row_is_decode = torch.arange(num_rows) < num_decode_tokens
    prefill_seq_lens = seq_lens[num_decodes:]
    decode_identity = decode_rows_use_identity(int(seq_lens.max()) if reqs else 0, spec.topk)
    prefill_identity = prefill_rows_use_identity(
        int(prefill_seq_lens.max()) if num_decodes < len(reqs) else 0, spec.topk
    )
    identity = torch.where(row_is_decode, torch.tensor(decode_identity), torch.tensor(prefill_identity))
    return RowPlan(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        ctx=ctx,
        identity=identity,
        regime=classify_rows(ctx, identity, spec.topk, spec.kpool),
        prefills_to_mha=route_prefills_to_mha(prefill_seq_lens, spec.topk),
    )


def build_scenario(spec: BatchSpec, seed: int) -> Scenario:
    """Host-side tensors of one step (no q, no KV cache: see :func:`build_attention_inputs`)."""
    reqs = spec.requests
    rows = plan_rows(spec)
    seq_lens, qsl, ctx, identity = rows.seq_lens, rows.query_start_loc, rows.ctx, rows.identity
    num_rows = int(qsl[-1])
    num_decodes, num_decode_tokens = rows.num_decodes, rows.num_decode_tokens
    is_decode = [r.q_len <= spec.decode_threshold for r in reqs]

    rng = np.random.default_rng(component_seed(seed, "blocks"))
    allocs, num_blocks = _allocate_blocks(spec, rng)
    table_width = max((a.size for a in allocs), default=0) + spec.table_slack
    table = _block_table(allocs, max(table_width, 1), num_blocks, rng)

    topk_indices = indexer_rows_fast(
        ctx, identity, spec.topk, spec.kpool, spec.resolved_width, component_seed(seed, "indexer"), spec.padded_rows
    )
    upper = seq_lens.clone()
    spec_decode = torch.tensor([d and r.q_len > 1 for d, r in zip(is_decode, reqs, strict=True)], dtype=torch.bool)
    upper[spec_decode] += spec.host_bound_slack
    positions = torch.zeros(num_rows + spec.padded_rows, dtype=torch.int64)
    positions[:num_rows] = ctx - 1
    num_actual_tokens, num_prefills = num_rows, len(reqs) - num_decodes
    if spec.full_graph:
        # vLLM's runner under a FULL graph: the token count is the capture size, every request
        # (the padded ones too) a decode, and the positions past the real tokens hold what an
        # earlier step left in the persistent buffer
        num_actual_tokens = num_decode_tokens = num_rows + spec.padded_rows
        num_decodes, num_prefills = len(reqs), 0
        stale = np.random.default_rng(component_seed(seed, "stale-positions"))
        positions[num_rows:] = torch.from_numpy(stale.integers(0, 4 * spec.topk, spec.padded_rows))
        table[[i for i, r in enumerate(reqs) if not r.q_len]] = NULL_BLOCK_ID
    if not spec.with_host_bound:
        upper = None
    if not spec.with_positions:
        positions = None
    meta = StepMetadata(
        num_reqs=len(reqs),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=upper,
        positions=positions,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefills=num_prefills,
        num_actual_tokens=num_actual_tokens,
    )
    return Scenario(
        spec=spec,
        seed=seed,
        meta=meta,
        block_table=torch.from_numpy(table),
        allocations=[torch.from_numpy(a.astype(np.int64)) for a in allocs],
        num_blocks=num_blocks,
        topk_indices=topk_indices,
        row_ctx=ctx,
        row_identity=identity,
        row_regime=rows.regime,
        prefills_to_mha=rows.prefills_to_mha,
    )


def single_token_decodes(spec: BatchSpec) -> list[int]:
    """The requests that decode one token this step (one query row: a decode at any threshold)."""
    return [i for i, r in enumerate(spec.requests) if r.q_len == 1]


def with_rejected_drafts(scenario: Scenario, slack: int) -> Scenario:
    """The scenario one step after its single-token decodes had ``slack`` drafts each that the
    verification rejected: vLLM's runner counted them as accepted when it made this step's host
    bound (``optimistic_seq_lens_cpu``), so the host bound of each request that decodes one token
    now over-counts by ``slack``, like that of a spec-decode request (``BatchSpec.host_bound_slack``,
    which :func:`build_scenario` adds to requests of more than one query row only). The seq_lens
    and positions stay exact. Needs async scheduling and a host bound: without either the bound
    is exact or not read (docs/input-space.md#rejected-drafts-then-one-token)."""
    spec, meta = scenario.spec, scenario.meta
    if not spec.async_scheduling or meta.seq_lens_cpu_upper_bound is None:
        raise ValueError("rejected drafts over-count the host bound only under async scheduling with a host bound")
    if slack < 1:
        raise ValueError(f"slack must be at least one rejected draft, got {slack}")
    upper = meta.seq_lens_cpu_upper_bound.clone()
    upper[single_token_decodes(spec)] += slack
    return dataclasses.replace(scenario, meta=dataclasses.replace(meta, seq_lens_cpu_upper_bound=upper))


#: The draft steps whose top-k rows MTP with shared indices reuses (draft step 0 computes them).
MTP_DRAFT_STEPS = (1, 2, 3)


def with_shared_mtp_indices(scenario: Scenario, draft_step: int) -> Scenario:
    """The scenario as draft step ``draft_step`` of MTP with shared top-k indices runs it (vLLM
    0.34.0's speculator with ``index_share_for_mtp_iteration``): draft step 0 computed each
    request's top-k at its last token, context ``L``, and ``compact_topk_indices`` kept that row;
    draft step ``k`` skips the indexer and hands the backend the kept row while its one query
    token is at context ``L + k``. So each single-token decode's row here is the indexer's row at
    context ``ctx - k`` (identity fill where step 0's longest context was within topk), drawn from
    a generator keyed by the scenario's seed; its metadata (seq_lens, positions) stays at ``ctx``
    (docs/input-space.md#mtp-with-shared-top-k-indices)."""
    if draft_step not in MTP_DRAFT_STEPS:
        raise ValueError(f"draft_step must be one of {MTP_DRAFT_STEPS}, got {draft_step}")
    spec = scenario.spec
    decodes = single_token_decodes(spec)
    if not decodes:
        raise ValueError("MTP's draft steps decode one token per request: the step has no single-token decode")
    starts = scenario.meta.query_start_loc_cpu.tolist()
    rows = [starts[i] for i in decodes]
    step0 = [int(scenario.row_ctx[r]) - draft_step for r in rows]
    if min(step0) < 1:
        raise ValueError(f"draft step {draft_step} needs every decode's context past {draft_step}, got "
                         f"{[int(scenario.row_ctx[r]) for r in rows]}")
    identity = decode_rows_use_identity(max(step0), spec.topk)
    kept = indexer_rows_fast(torch.tensor(step0), torch.full((len(rows),), identity), spec.topk, spec.kpool,
                             spec.resolved_width, component_seed(scenario.seed, f"mtp-step0-{draft_step}"))
    topk = scenario.topk_indices.clone()
    topk[rows] = kept
    return dataclasses.replace(scenario, topk_indices=topk, extra={**scenario.extra, "mtp_draft_step": draft_step})


def even_host_split(spec: BatchSpec, verifying: int) -> list[int]:
    """The host's placeholder query split under adaptive verification for a step whose device split
    is ``spec``'s own: the first ``verifying`` requests (the verification requests, which vLLM's
    runner keeps first) each keep their one non-draft token and share the step's draft budget (their
    device drafts together) evenly, the first ones one more; every other request keeps its query
    length (docs/input-space.md#a-device-query-split-that-differs-from-the-hosts)."""
    q_lens = [r.q_len for r in spec.requests]
    if not 1 <= verifying <= leading_decodes(spec) or 0 in q_lens[:verifying]:
        raise ValueError(f"the {verifying} verification requests must be decodes with a query row each: "
                         f"{spec.requests}")
    budget = sum(q_lens[:verifying]) - verifying
    shares = [1 + budget // verifying + (i < budget % verifying) for i in range(verifying)]
    return shares + q_lens[verifying:]


def host_split_problem(spec: BatchSpec, host_q_lens) -> str | None:
    """Why ``host_q_lens`` is not a host split vLLM's runner makes beside ``spec``'s device split,
    or None: as many requests and rows; adaptive verification moves draft rows between decode
    requests only (a request without query rows and every prefill keep theirs), and a decode holds
    at most ``decode_threshold`` rows on either split."""
    device = [r.q_len for r in spec.requests]
    host = [int(q) for q in host_q_lens]
    decodes = leading_decodes(spec)
    if len(host) != len(device) or sum(host) != sum(device):
        return f"the host split {host} must hold the {len(device)} requests and {sum(device)} rows of {device}"
    if spec.full_graph:
        return "a FULL graph step's uniform decode batch has one split"
    moved = [i for i, (h, d) in enumerate(zip(host, device, strict=True))
             if h != d and (i >= decodes or d == 0 or not 1 <= h <= spec.decode_threshold)]
    if moved:
        return (f"requests {moved}: only decode rows move between the splits, each decode 1 to "
                f"{spec.decode_threshold} rows (host {host}, device {device})")
    return None


def with_host_query_split(scenario: Scenario, host_q_lens) -> Scenario:
    """The scenario as vLLM's runner hands it to attention under adaptive verification: the host
    holds a placeholder query split (``query_start_loc_cpu`` from ``host_q_lens``, e.g.
    :func:`even_host_split`), the device the split the step runs (``query_start_loc``: the spec's
    own), which decides each row's request, and with it its context, its indexer row, its position
    and its intended selection, as the scenario built them. The host bound stays each request's
    (at least its seq_len on the device), so every row's context is below the largest. A scenario
    whose two splits agree is returned as it is."""
    spec, meta = scenario.spec, scenario.meta
    problem = host_split_problem(spec, host_q_lens)
    if problem:
        raise ValueError(problem)
    if [int(q) for q in host_q_lens] == [r.q_len for r in spec.requests]:
        return scenario
    host = torch.zeros(len(spec.requests) + 1, dtype=torch.int32)
    host[1:] = torch.cumsum(torch.tensor([int(q) for q in host_q_lens], dtype=torch.int32), 0)
    meta = dataclasses.replace(meta, query_start_loc_cpu=host, query_start_loc=meta.query_start_loc_cpu)
    return dataclasses.replace(scenario, meta=meta)


def host_split_of(scenario: Scenario) -> list[int] | None:
    """The host's query split of a scenario whose device split differs from it (as
    :func:`with_host_query_split` made it): each request's query rows on the host; None where the
    device runs the host's split."""
    if scenario.meta.query_start_loc is None:
        return None
    return torch.diff(scenario.meta.query_start_loc_cpu).tolist()
