"""One compatibility layer over FlashInfer's ``BatchMLAPagedAttentionWrapper``, 0.5.3 to 0.7.x.

What differs between versions, detected from the installed version and the wrapper's
signatures (never assumed from the version alone where a signature can tell):

- 0.7.0+: canonical ``plan(metadata=MLAPlanMetadata.csr(...), query_layout="split",
  kv_cache_layout="split", lse_mode=...)`` and ``run(query=(q_nope, q_pe),
  kv_cache=(ckv, kpe))``; the flat forms still work there but warn (DeprecationWarning).
  Before: flat positional metadata and separate tensors.
- LSE: FlashInfer returns base 2 unless asked for natural log (``return_lse_base_on_e``,
  and ``lse_mode="basee"`` at plan time on 0.7+). This layer always hands back natural-log
  LSE: it asks for base e where it can, else converts base 2 in place (capturable).
- NoPE (``head_dim_kpe == 0``) needs >= 0.6.18; fp8 KV needs >= 0.6.14 (bf16 q, per-tensor
  ``ckv_scale``/``kpe_scale`` at run). An fp8 cache is planned as ``torch.float8_e4m3fn``,
  never as its storage dtype.

What a release checks before it launches differs within one minor series (0.7.0.post1 and
0.7.2.post1 have the plan-time page-count check but launch a run whose cache does not cover
the planned pages; 0.7.4 refuses that run), so those behaviours are probed on the GPU, never
derived from the version: :func:`probe_behaviour`, cached once per process and device by
``detect_features(device)``. ``Features.describe()`` names what was found.

Every warning FlashInfer raises inside a call made here is recorded (and not re-emitted)
so that reports can show deprecations: see :func:`recorded_warnings`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mla_constants import KV_LORA_RANK, ROPE_DIM

from ..seam import SYNC_WARNING
from .installed import PAGE_COUNT_REFUSAL as PAGE_COUNT_REFUSAL

NOPE_MIN_VERSION = (0, 6, 18)
FP8_KV_MIN_VERSION = (0, 6, 14)
CANONICAL_MIN_VERSION = (0, 7, 0)
SUPPORTED_RANGE = ((0, 5, 3), (0, 8, 0))  # [low, high)
LN_2 = math.log(2.0)
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.uint8)
WORKSPACE_BYTES = 128 * 1024 * 1024  # the float workspace each wrapper gets (the SM90 state's and the probe's)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.6.18.post1"`` -> ``(0, 6, 18)``; trailing tags (post, rc, dev, +local) ignored."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"cannot parse a FlashInfer version from {text!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)



@dataclass(frozen=True)
class ProbedBehaviour:
    """One check a release may make before launching, found out by :func:`probe_behaviour`: the
    one declaration that ``Features``, its report (``describe()``), the tests and the docs'
    table read."""

    name: str  # the Features attribute: True when the installed release makes the check
    meaning: str  # what True means
    how: str  # how the probe finds out
    source: str  # where a release's source makes the check
    releases_checking: frozenset[str]  # of RELEASES_READ, those whose source makes it


#: The releases whose wheel sources were read for each ProbedBehaviour (only to check the probe
#: on them: the suite keys on what the probe finds).
RELEASES_READ = ("0.6.18.post1", "0.7.0.post1", "0.7.2.post1", "0.7.4")

PROBED_BEHAVIOURS = (
    ProbedBehaviour(
        "plan_checks_page_counts",
        "plan() refuses kv_indptr page counts other than ceil(kv_len / page_size)",
        "plan with `kv_indptr` counting 2 pages for `kv_len` 1 (host only: nothing launched)",
        "`_batch_mla/_planning.py`",
        frozenset({"0.7.0.post1", "0.7.2.post1", "0.7.4"}),
    ),
    ProbedBehaviour(
        "run_checks_cache_coverage",
        "run() refuses a KV cache that does not cover the planned page indices",
        "run on a view of the cache's first slot only, after a control run on both slots; the view's storage holds "
        "slot 1, so a release without the check reads allocated memory",
        "`_check_planned_geometry`",
        frozenset({"0.7.4"}),
    ),
    ProbedBehaviour(
        "coverage_from_plan_slots",
        "run()'s coverage check judges the slot ids kv_indices held at plan(), not those it reads at run()",
        "plan with kv_indices holding a slot past the cache, write the planned slot into it, then run on a cache "
        "that covers the planned slot (a release that reads the slots at run launches on them)",
        "`_plan_generated_fa`: `torch.aminmax(kv_indices[page_start:page_end])`",
        frozenset({"0.7.4"}),
    ),
    ProbedBehaviour(
        "run_checks_query_shape",
        "run() refuses q rows other than the planned rows",
        "run with 2 q rows for the 1 planned row (the kernel reads the planned row only)",
        "`_check_planned_geometry`",
        frozenset({"0.7.4"}),
    ),
)
PROBED_NAMES = tuple(b.name for b in PROBED_BEHAVIOURS)


@dataclass(frozen=True)
class Behaviour:
    """What the installed FlashInfer checks before it launches: one bool per
    :data:`PROBED_BEHAVIOURS` entry, read by name (``behaviour.plan_checks_page_counts``)."""

    checks: tuple[bool, ...]  # in PROBED_BEHAVIOURS order

    def __post_init__(self):
        if len(self.checks) != len(PROBED_NAMES):
            raise ValueError(f"Behaviour needs one bool per probed behaviour {PROBED_NAMES}, got {self.checks}")

    @classmethod
    def of(cls, **found: bool) -> Behaviour:
        """From ``name=bool`` for every probed behaviour."""
        if set(found) != set(PROBED_NAMES):
            raise ValueError(f"Behaviour.of needs exactly {PROBED_NAMES}, got {sorted(found)}")
        return cls(tuple(bool(found[name]) for name in PROBED_NAMES))

    @classmethod
    def in_source(cls, release: str) -> Behaviour:
        """What the source of a release of :data:`RELEASES_READ` checks."""
        return cls(tuple(release in b.releases_checking for b in PROBED_BEHAVIOURS))

    def items(self) -> list[tuple[str, bool]]:
        return list(zip(PROBED_NAMES, self.checks, strict=True))

    def __getattr__(self, name: str) -> bool:
        if name in PROBED_NAMES:
            return self.checks[PROBED_NAMES.index(name)]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass(frozen=True)
class Features:
    """What the installed FlashInfer offers for the sparse-MLA path: call forms from the
    wrapper's signatures, version gates, and (where probed on a GPU, else None) what its
    plan() and run() check before launching."""

    version: str
    canonical_plan: bool  # plan(metadata=MLAPlanMetadata.csr(...), query_layout=, kv_cache_layout=)
    structural_run: bool  # run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))
    plan_lse_mode: bool  # plan(lse_mode="basee")
    run_lse_base_e: bool  # run(return_lse_base_on_e=True)
    run_kv_scales: bool  # run(ckv_scale=, kpe_scale=)
    nope: bool
    fp8_kv: bool
    behaviour: Behaviour | None = None  # probed on a GPU; its checks read as attributes (None: not probed)

    def __getattr__(self, name: str) -> bool | None:
        """A probed behaviour by name (``features.run_checks_cache_coverage``); None when not probed."""
        if name in PROBED_NAMES:
            behaviour = self.__dict__.get("behaviour")
            return None if behaviour is None else getattr(behaviour, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def version_tuple(self) -> tuple[int, int, int]:
        return parse_version(self.version)

    @property
    def probed(self) -> bool:
        return self.behaviour is not None

    def describe(self) -> str:
        """``flashinfer V: <call forms and gates>; probed: <each behaviour: yes / no>`` (or
        ``not probed``)."""
        on = [name for name in ("canonical_plan", "structural_run", "plan_lse_mode", "run_lse_base_e",
                                "run_kv_scales", "nope", "fp8_kv") if getattr(self, name)]
        if self.probed:
            found = ", ".join(f"{name} {'yes' if checks else 'no'}" for name, checks in self.behaviour.items())
        else:
            found = "not probed"
        return f"flashinfer {self.version}: " + ", ".join(on) + f"; probed: {found}"


def features_from(version: str, plan_params, run_params, has_plan_metadata: bool) -> Features:
    """Features from a version string and the parameter names of ``plan``/``run`` (pure);
    the probed behaviours stay None."""
    v = parse_version(version)
    plan_params, run_params = set(plan_params), set(run_params)
    run_kv_scales = {"ckv_scale", "kpe_scale"} <= run_params
    return Features(
        version=version,
        canonical_plan=has_plan_metadata and {"metadata", "query_layout", "kv_cache_layout"} <= plan_params,
        structural_run={"query", "kv_cache"} <= run_params,
        plan_lse_mode="lse_mode" in plan_params,
        run_lse_base_e="return_lse_base_on_e" in run_params,
        run_kv_scales=run_kv_scales,
        nope=v >= NOPE_MIN_VERSION,
        fp8_kv=v >= FP8_KV_MIN_VERSION and run_kv_scales,
    )


def signature_features() -> Features:
    """Features of the FlashInfer importable here from its version and signatures, nothing
    probed (host only; raises ImportError without FlashInfer)."""
    with recording():
        import flashinfer
        import flashinfer.mla as mla
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    return features_from(
        flashinfer.__version__,
        inspect.signature(BatchMLAPagedAttentionWrapper.plan).parameters,
        inspect.signature(BatchMLAPagedAttentionWrapper.run).parameters,
        hasattr(mla, "MLAPlanMetadata"),
    )


def detect_features(device=None) -> Features:
    """Features of the FlashInfer importable here. With a CUDA ``device`` the behaviours of
    :data:`PROBED_BEHAVIOURS` are probed on it as well (once per process and device)."""
    features = signature_features()
    if device is None:
        return features
    return dataclasses.replace(features, behaviour=_probed_once(str(torch.device(device))))


@functools.cache
def _probed_once(device: str) -> Behaviour:
    return probe_behaviour(device, features=signature_features())


def unsupported_reason(features: Features, *, rope_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why this FlashInfer cannot run a configuration (a skip reason), or None."""
    v = features.version_tuple
    if not SUPPORTED_RANGE[0] <= v < SUPPORTED_RANGE[1]:
        return f"flashinfer {features.version} is outside the supported range 0.5.3 to 0.7.x"
    if rope_dim == 0 and not features.nope:
        return f"NoPE (head_dim_kpe = 0) needs flashinfer >= 0.6.18, found {features.version}"
    if kv_dtype in FP8_KV_DTYPES and not features.fp8_kv:
        return f"fp8 KV needs flashinfer >= 0.6.14 with run(ckv_scale=, kpe_scale=), found {features.version}"
    return None


def planning_kv_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype to plan with: an fp8 cache (stored as float8_e4m3fn or as raw uint8) is
    planned as float8_e4m3fn, never as its storage dtype."""
    if kv_dtype in FP8_KV_DTYPES:
        return torch.float8_e4m3fn
    if kv_dtype in (torch.bfloat16, torch.float16):
        return kv_dtype
    raise ValueError(f"unsupported KV cache dtype {kv_dtype}")


def kernel_kv_view(cache_part: torch.Tensor) -> torch.Tensor:
    """The cache as the kernel must see it: raw uint8 fp8 storage reinterpreted as e4m3."""
    return cache_part.view(torch.float8_e4m3fn) if cache_part.dtype == torch.uint8 else cache_part


def fa3_mla_cluster_size(total_q: int, num_heads: int, batch_size: int) -> int:
    """The thread-block cluster size FlashInfer's fa3 MLA scheduler picks at plan time (2 when
    the average packed query length ``total_q * num_heads // batch_size`` exceeds 64, else 1).
    ``batch_size`` is the length of kv_len_arr (the reserved row count under CUDA graphs). A
    captured launch keeps the cluster size of the plan it was captured after."""
    return 2 if batch_size and total_q * num_heads // batch_size > 64 else 1


# --- warnings ------------------------------------------------------------------------------

_RECORDED: list[tuple[str, str]] = []


@contextmanager
def recording():
    """Record (not re-emit) every warning raised inside the block, except torch's warning of a
    device synchronisation (under ``torch.cuda.set_sync_debug_mode``), which goes on to whoever
    counts them (``backends.seam.device_syncs_counted``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if SYNC_WARNING in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            _RECORDED.append((w.category.__name__, str(w.message)))


def recorded_warnings() -> list[tuple[str, str]]:
    """Every warning recorded so far in this process, in order, duplicates included."""
    return list(_RECORDED)


def distinct_warnings(since: int = 0) -> list[str]:
    """``"Category: message"`` of the warnings recorded from index ``since`` on, deduplicated."""
    return list(dict.fromkeys(f"{c}: {m}" for c, m in _RECORDED[since:]))


# --- the wrapper ---------------------------------------------------------------------------


#: FlashInfer's MLA backends the suite runs: fa3 (what ``auto`` picks on SM90 and production
#: runs) and fa2 (the same wrapper's other SM90-capable kernel).
MLA_KERNELS = ("fa3", "fa2")


class MLAWrapper:
    """``BatchMLAPagedAttentionWrapper(workspace, use_cuda_graph=True, backend=kernel)`` with
    reserved metadata buffers, called the way the installed version wants."""

    def __init__(
        self,
        workspace: torch.Tensor,
        *,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        features: Features | None = None,
        lse_base_e: bool = True,
        kernel: str = "fa3",
    ):
        if kernel not in MLA_KERNELS:
            raise ValueError(f"kernel must be one of {MLA_KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.features = features or detect_features()
        self.lse_base_e = lse_base_e  # False: read FlashInfer's base-2 LSE raw (no normalisation)
        with recording():
            from flashinfer.mla import BatchMLAPagedAttentionWrapper

            self._wrapper = BatchMLAPagedAttentionWrapper(
                workspace,
                use_cuda_graph=True,
                qo_indptr=qo_indptr,
                kv_indptr=kv_indptr,
                kv_indices=kv_indices,
                kv_len_arr=kv_len_arr,
                backend=kernel,
            )
        self._kv_dtype: torch.dtype | None = None
        self._kernel_lse_base_e = False

    @property
    def asks_natural_lse(self) -> bool:
        """Whether FlashInfer itself is asked for natural-log LSE."""
        return self.lse_base_e and self.features.run_lse_base_e

    def plan(
        self,
        *,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        sm_scale: float,
        kv_dtype: torch.dtype,
        q_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Plan page_size 1, non-causal. ``kv_dtype`` may be a storage dtype (uint8)."""
        reason = unsupported_reason(self.features, rope_dim=head_dim_kpe, kv_dtype=kv_dtype)
        if reason:
            raise NotImplementedError(reason)
        planned_kv = planning_kv_dtype(kv_dtype)
        common = dict(
            num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=1,
            causal=False, sm_scale=float(sm_scale), q_data_type=q_dtype, kv_data_type=planned_kv,
        )
        with recording():
            if self.features.canonical_plan:
                from flashinfer.mla import MLAPlanMetadata

                lse_mode = "basee" if self.asks_natural_lse else "base2"
                self._wrapper.plan(
                    metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr),
                    query_layout="split", kv_cache_layout="split", lse_mode=lse_mode, **common,
                )
            else:
                self._wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, **common)
        self._kv_dtype = planned_kv
        self._kernel_lse_base_e = self.asks_natural_lse

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        *,
        out: torch.Tensor,
        lse: torch.Tensor,
        k_scale: float = 1.0,
    ) -> None:
        """Attention into ``out`` and ``lse``; ``lse`` is natural log (unless ``lse_base_e``
        was turned off). Launches device work only: capturable."""
        if self._kv_dtype is None:
            raise RuntimeError("run() before plan()")
        ckv, kpe = kernel_kv_view(ckv), kernel_kv_view(kpe)
        kwargs = dict(out=out, lse=lse, return_lse=True)
        if self.features.run_lse_base_e:
            kwargs["return_lse_base_on_e"] = self._kernel_lse_base_e
        if self._kv_dtype == torch.float8_e4m3fn:
            kwargs.update(ckv_scale=float(k_scale), kpe_scale=float(k_scale))
        elif k_scale != 1.0:
            raise ValueError(f"k_scale={k_scale} with a {self._kv_dtype} cache (only fp8 is scaled)")
        with recording():
            if self.features.structural_run:
                self._wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), **kwargs)
            else:
                self._wrapper.run(q_nope, q_pe, ckv, kpe, **kwargs)
        if self.lse_base_e and not self._kernel_lse_base_e:
            lse.mul_(LN_2)


# --- probed behaviour ----------------------------------------------------------------------

#: The probe plans one query row of PROBE_HEADS heads reading slot PROBE_SLOT, with the kernel
#: variant the GPU tier builds anyway (bf16 q and KV, head_dim_ckv 512, rope 64), so it
#: compiles nothing of its own.
PROBE_HEADS = 16
PROBE_SLOT = 1
#: The slot kv_indices holds when the stale-slot probe plans: past the probe's cache of
#: PROBE_SLOT + 1 slots, as a step's buffer holds the previous step's slots when it is planned
#: before its own are written.
STALE_SLOT = PROBE_SLOT + 2


class ProbeError(RuntimeError):
    """The installed FlashInfer did something the probe cannot classify."""


def refusal(call) -> str | None:
    """The message of the ValueError ``call()`` raises, or None when it returns. Any other
    exception propagates."""
    try:
        call()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return None


def classify_run(what: str, refused: str | None, wrote: bool) -> bool:
    """True when a run was refused before launching, False when it launched; ProbeError for
    anything else (refused after writing its output, or returned without writing it)."""
    if refused is not None and not wrote:
        return True
    if refused is None and wrote:
        return False
    if refused is not None:
        raise ProbeError(f"{what}: refused ({refused}) after writing its output")
    raise ProbeError(f"{what}: returned without writing its output")


def probe_behaviour(device, *, features: Features | None = None, make_wrapper=None) -> Behaviour:
    """Find out what the installed FlashInfer's plan() and run() check, by calling them.

    One wrapper, one query row planned to read slot ``PROBE_SLOT`` (page size 1):

    - plan with ``kv_indptr`` counting 2 pages for ``kv_len`` 1: refused or accepted (plan
      only, nothing launched either way);
    - run on a cache of ``PROBE_SLOT + 1`` slots: must launch and write the row (the control);
    - run on a view of its first ``PROBE_SLOT`` slots, which does not cover the planned slot:
      refused, or launched, reading the slot that the view leaves out but the allocation holds
      (memory-safe either way);
    - run with 2 q rows for the 1 planned row: refused, or launched (the kernel reads the
      planned row only);
    - plan while kv_indices holds ``STALE_SLOT`` (past the cache), write ``PROBE_SLOT`` into it,
      and run on the cache that covers it: refused where run() judges coverage by the slots
      kv_indices held at plan, launched on ``PROBE_SLOT`` where the slots are read at run.

    ``make_wrapper`` defaults to :class:`MLAWrapper` (tests pass a fake)."""
    dev = torch.device(device)
    make_wrapper = make_wrapper or MLAWrapper
    i32 = dict(dtype=torch.int32)
    kv_indices = torch.full((2,), PROBE_SLOT, device=dev, **i32)  # room for the 2-page plan
    wrapper = make_wrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
        qo_indptr=torch.zeros(2, device=dev, **i32), kv_indptr=torch.zeros(2, device=dev, **i32),
        kv_indices=kv_indices, kv_len_arr=torch.zeros(1, device=dev, **i32), features=features,
    )

    def plan(pages: int) -> None:
        wrapper.plan(
            qo_indptr=torch.tensor([0, 1], **i32), kv_indptr=torch.tensor([0, pages], **i32), kv_indices=kv_indices,
            kv_len_arr=torch.tensor([1], **i32), num_heads=PROBE_HEADS, head_dim_ckv=KV_LORA_RANK,
            head_dim_kpe=ROPE_DIM, sm_scale=1.0, kv_dtype=torch.bfloat16,
        )

    bf16 = dict(dtype=torch.bfloat16, device=dev)
    ckv = torch.zeros(PROBE_SLOT + 1, 1, KV_LORA_RANK, **bf16)
    kpe = torch.zeros(PROBE_SLOT + 1, 1, ROPE_DIM, **bf16)
    q_nope = torch.zeros(2, PROBE_HEADS, KV_LORA_RANK, **bf16)
    q_pe = torch.zeros(2, PROBE_HEADS, ROPE_DIM, **bf16)

    def run(q_rows: int, cache_slots: int) -> tuple[str | None, bool]:
        out = torch.full((q_rows, PROBE_HEADS, KV_LORA_RANK), float("nan"), **bf16)
        lse = torch.full((q_rows, PROBE_HEADS), float("nan"), dtype=torch.float32, device=dev)
        refused = refusal(lambda: wrapper.run(q_nope[:q_rows], q_pe[:q_rows], ckv[:cache_slots], kpe[:cache_slots],
                                              out=out, lse=lse))
        return refused, not bool(out[0].isnan().any())

    control = refusal(lambda: plan(1))
    if control is not None:
        raise ProbeError(f"the probe's own plan was refused: {control}")
    plan_checks = refusal(lambda: plan(2)) is not None
    plan(1)
    refused, wrote = run(1, PROBE_SLOT + 1)
    if refused is not None:
        raise ProbeError(f"the control run (a cache that covers the planned slot) was refused: {refused}")
    classify_run("the control run", refused, wrote)
    coverage = classify_run("the run on a cache short of the planned slot", *run(1, PROBE_SLOT))
    query_shape = classify_run("the run with more q rows than planned", *run(2, PROBE_SLOT + 1))
    kv_indices.fill_(STALE_SLOT)
    plan(1)
    kv_indices.fill_(PROBE_SLOT)
    from_plan = classify_run("the run planned on a stale slot", *run(1, PROBE_SLOT + 1))
    plan(1)  # the wrapper is left planned for its one row on the slot kv_indices holds
    return Behaviour.of(plan_checks_page_counts=plan_checks, run_checks_cache_coverage=coverage,
                        coverage_from_plan_slots=from_plan, run_checks_query_shape=query_shape)
