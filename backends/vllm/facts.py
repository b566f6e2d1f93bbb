"""What each vLLM release's SM90 sparse backend is, as data keyed by the release's version: the
facts the tester judges a release by, and the check of the release's code against them.

The version comes from what the release declares (its wheel's or slice's METADATA); every other
fact comes from this table, never from the code under test. The code is then checked against
the facts (:func:`feature_problems`): a release whose module lacks a feature its facts promise
fails, naming the feature (``tests/cpu/test_vllm_backend.py``), where reading the fact from the
code would have made it look like an older release that legitimately lacks it (skipped steps, a
new bug absorbed into an old finding).

Each row says what the release declares of itself and what its backend does:

- ``design``: ``exact`` (0.30: exact host lengths, a plan every step, the strided layout) or
  ``bounded`` (0.31 on: host upper bounds, a kept plan, the device clamp of the schedule,
  ``_SM90State._clamp_kv_end``);
- ``fp8_plan_dtype``: the dtype its builder plans an fp8 cache with (``uint8``, the cache spec's
  storage dtype, in 0.30 and 0.31; ``float8_e4m3fn``, mapped before plan, from 0.32);
- ``reads_block_stride``: whether its cache's blocks may lie apart (0.32 on declares
  ``customize_spec`` with ``align_blocks_to_rows`` and hands the convert kernel
  ``BLOCK_STRIDE_ROWS``; 0.30 and 0.31 declare ``supported_kv_cache_layouts`` = LBHNC alone);
- ``reads_adaptive_verification``: whether its builder reads the speculative config's
  ``enable_adaptive_verification`` (0.31 on);
- ``minus_one_filler``: what a -1 inside a row's planned length is packed as
  (``mla_constants``' fillers);
- ``flashinfer_pin``: the ``flashinfer-python`` its METADATA requires;
- ``module_sha256``: the sha256 of its ``flashinfer_mla_sparse_sm90.py`` as released (0.32.0 to
  0.34.0 ship one file).

A release not in the table is judged with the facts of the newest known release of its design
(the one fact read from its code, as :func:`backends.vllm.source.design_of` reads it), and the
run's header says so.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mla_constants import FIRST_SLOT, SLOT_ZERO

FACTS_MODULE = "backends/vllm/facts.py"


@dataclass(frozen=True)
class ReleaseFacts:
    release: str
    design: str
    fp8_plan_dtype: str
    reads_block_stride: bool
    reads_adaptive_verification: bool
    minus_one_filler: str
    flashinfer_pin: str
    module_sha256: str

    @property
    def plans_fp8_as_storage_dtype(self) -> bool:
        return self.fp8_plan_dtype == "uint8"


_SM90_0_32 = "480f2060f82313f32e149af00e8e988d01e37b95e96e45a696c07b25b7a32327"

#: Every known release, oldest first.
RELEASES = {facts.release: facts for facts in (
    ReleaseFacts("0.30.0", "exact", "uint8", False, False, SLOT_ZERO, "0.6.18.post1",
                 "df9fe4970aa3f53cf24784b8534b89e0101a2ca20a35a2ebbc9a12a4463d5993"),
    ReleaseFacts("0.31.0", "bounded", "uint8", False, True, SLOT_ZERO, "0.7.0.post1",
                 "b6eb475f8e09b5a6e21a3a840a7fa2874c8298561f52d5b1872b54a0121c3380"),
    ReleaseFacts("0.32.0", "bounded", "float8_e4m3fn", True, True, FIRST_SLOT, "0.7.0.post1", _SM90_0_32),
    ReleaseFacts("0.33.0", "bounded", "float8_e4m3fn", True, True, FIRST_SLOT, "0.7.2.post1", _SM90_0_32),
    ReleaseFacts("0.34.0", "bounded", "float8_e4m3fn", True, True, FIRST_SLOT, "0.7.3", _SM90_0_32),
)}


def version_key(version: str) -> tuple[int, ...]:
    """``(0, 33, 0)`` for ``0.33.0``, ``(0, 35, 0)`` for ``0.35.0rc1+cu130`` (the leading numbers)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


@dataclass(frozen=True)
class JudgedFacts:
    """The facts a release is judged by; ``borrowed``: why they are another release's (a release
    the table does not know), empty for a known release."""

    facts: ReleaseFacts
    borrowed: str = ""

    def describe(self) -> str:
        return self.borrowed or f"facts of vLLM {self.facts.release} ({FACTS_MODULE})"

    def summary(self) -> str:
        """Every fact in one line, then where they come from: what a run's header says it judged."""
        f = self.facts
        return (f"{f.design} design, fp8 planned as {f.fp8_plan_dtype}, "
                f"{'any block stride' if f.reads_block_stride else 'contiguous blocks'}, "
                f"{'reads' if f.reads_adaptive_verification else 'no'} adaptive verification, -1 inside a row's "
                f"length packed as {f.minus_one_filler}, pins flashinfer-python {f.flashinfer_pin}; {self.describe()}")


def facts_for(version: str, design_in_code: str) -> JudgedFacts:
    """The facts vLLM ``version`` is judged by: its own row; for a release the table does not
    know, the newest known release of ``design_in_code`` (its design as its code shows it)."""
    if version in RELEASES:
        return JudgedFacts(RELEASES[version])
    same = [f for f in RELEASES.values() if f.design == design_in_code] or list(RELEASES.values())
    newest = max(same, key=lambda f: version_key(f.release))
    return JudgedFacts(newest, f"vLLM {version} is not a known release ({FACTS_MODULE}): judged with the facts of "
                               f"{newest.release}, the newest known release of its {design_in_code} design")


def facts_of_release(version: str, design_in_code: str) -> ReleaseFacts:
    """:func:`facts_for`'s facts, carrying ``version`` as their release."""
    return dataclasses.replace(facts_for(version, design_in_code).facts, release=version)


@dataclass(frozen=True)
class CodeFeatures:
    """What a release's code shows of each fact (``None``: not shown, such as a pin where the
    source has no METADATA or a filler not probed)."""

    design: str
    fp8_plan_dtype: str
    hands_block_stride: bool
    declares_block_alignment: bool
    reads_adaptive_verification: bool
    minus_one_filler: str | None
    flashinfer_pin: str | None
    module_sha256: str


def feature_problems(version: str, facts: ReleaseFacts, code: CodeFeatures) -> list[str]:
    """Each feature ``facts`` promise that the code (``code``) lacks or contradicts, one line each
    naming the feature; a module that differs from the release's is named only where a feature
    does."""
    who = f"vLLM {version}"
    problems = []
    if code.design != facts.design:
        shown = "has" if code.design == "bounded" else "lacks"
        problems.append(f"{who} declares the {facts.design} design; its _SM90State {shown} the device clamp "
                        f"(_clamp_kv_end): the {code.design} design")
    if code.fp8_plan_dtype != facts.fp8_plan_dtype:
        problems.append(f"{who} declares planning an fp8 cache as {facts.fp8_plan_dtype}; its builder plans it as "
                        f"{code.fp8_plan_dtype}" + (" (it names no float8_e4m3fn)" if code.fp8_plan_dtype == "uint8"
                                                    else ""))
    if code.declares_block_alignment != facts.reads_block_stride:
        problems.append(f"{who} " + ("declares a cache whose blocks lie apart (customize_spec with "
                                     "align_blocks_to_rows); its backend class declares no customize_spec"
                                     if facts.reads_block_stride else
                                     "declares contiguous blocks (supported_kv_cache_layouts LBHNC alone); its "
                                     "backend class declares customize_spec"))
    if code.hands_block_stride != facts.reads_block_stride:
        problems.append(f"{who} " + ("reads the cache's block stride; its forward_mqa hands the convert kernel no "
                                     "BLOCK_STRIDE_ROWS" if facts.reads_block_stride else
                                     "reads contiguous blocks; its forward_mqa hands the convert kernel "
                                     "BLOCK_STRIDE_ROWS"))
    if code.reads_adaptive_verification != facts.reads_adaptive_verification:
        problems.append(f"{who} " + ("reads adaptive verification; its builder reads no "
                                     "enable_adaptive_verification" if facts.reads_adaptive_verification else
                                     "reads no adaptive verification; its builder reads enable_adaptive_verification"))
    if code.minus_one_filler is not None and code.minus_one_filler != facts.minus_one_filler:
        problems.append(f"{who} packs a -1 inside a row's planned length as {facts.minus_one_filler}; its code packs "
                        f"it as {code.minus_one_filler}")
    if code.flashinfer_pin is not None and code.flashinfer_pin != facts.flashinfer_pin:
        problems.append(f"{who} pins flashinfer-python {facts.flashinfer_pin}; its METADATA requires "
                        f"{code.flashinfer_pin}")
    if problems and code.module_sha256 != facts.module_sha256:
        problems.append(f"its flashinfer_mla_sparse_sm90.py (sha256 {code.module_sha256[:12]}) is not the one "
                        f"vLLM {facts.release} released ({facts.module_sha256[:12]})")
    return problems


def digest_problem(release: str | None, digest: str | None) -> str | None:
    """Where a written case's release and the sha256 of the SM90 module it ran disagree: the
    module is one a known release shipped, and not ``release``'s (0.32.0 to 0.34.0 ship one file).
    None where they agree, or where either is unknown (a module no release shipped, such as a
    copy with a bug planted, is named when the case is replayed)."""
    if digest is None or release not in RELEASES or digest == RELEASES[release].module_sha256:
        return None
    owners = [f.release for f in RELEASES.values() if f.module_sha256 == digest]
    if not owners:
        return None
    return (f"'backend.release' is {release}, but 'backend.module_digest' ({digest[:12]}) is the SM90 module of "
            f"vLLM {', '.join(owners)} ({FACTS_MODULE}): one of them was edited")
