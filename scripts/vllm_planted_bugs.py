"""Bugs planted in a copy of a vLLM release's SM90 module, for the journeys of a failing vLLM case
(dump, replay under the bug, replay on the release as shipped): ``tests/cpu/test_vllm_dump_replay.py``
on CPU, ``scripts/gpu_journeys.py --vllm`` on a GPU runner.

Each bug is one line of vLLM 0.33.0's ``flashinfer_mla_sparse_sm90.py`` changed:

- ``kept-plan``: the kept-plan condition keeps a plan while the bounds have outgrown it by up to
  40 tokens (only a sequence shows it: a plan is kept from one step to the next);
- ``clamp``: the device clamp cuts rows past topk one token short;
- ``host-lengths``: the host bounds are 64 tokens low;
- ``host-split-bound`` (:data:`HOST_SPLIT_BOUND`, not a journey's): under adaptive verification each
  row is bounded by its request under the host's query split, not by the longest request.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from backends.vllm.source import MODULE_FILES


@dataclass(frozen=True)
class PlantedBug:
    name: str
    shipped: str  # the line as vLLM 0.33.0 ships it
    planted: str


BUGS = (
    PlantedBug("kept-plan", "((planned >= kv_lens) & (planned <= kv_lens + _PLAN_SLACK)).all()",
               "((planned + 40 >= kv_lens) & (planned <= kv_lens + _PLAN_SLACK)).all()"),
    PlantedBug("clamp", "tl.maximum(tl.minimum(end, valid), start)",
               "tl.maximum(tl.minimum(end, valid - (ctx > TOPK).to(tl.int32)), start)"),
    PlantedBug("host-lengths", "return num_rows, torch.clamp(ctx, max=state.max_valid), False",
               "return num_rows, torch.clamp(ctx - 64, min=1, max=state.max_valid), False"),
)
BUGS_BY_NAME = {bug.name: bug for bug in BUGS}

#: Features vLLM 0.32.0 to 0.34.0 declare (``backends.vllm.facts``), each deleted from a copy of
#: the module, with the words the check of the code against the facts names it by: the module
#: then fails that check (``tests/cpu/test_vllm_backend.py``), where reading the fact from the
#: code made it pass for an older release that lacks the feature.
FEATURE_DELETIONS = (
    (PlantedBug("fp8-mapping", "        kv_plan_dtype = (\n            torch.float8_e4m3fn\n"
                               "            if kv_cache_spec.dtype == torch.uint8\n"
                               "            else kv_cache_spec.dtype\n        )",
                "        kv_plan_dtype = kv_cache_spec.dtype"),
     "declares planning an fp8 cache as float8_e4m3fn; its builder plans it as uint8"),
    (PlantedBug("block-stride", "            BLOCK_STRIDE_ROWS=block_stride_rows,\n", ""),
     "reads the cache's block stride; its forward_mqa hands the convert kernel no BLOCK_STRIDE_ROWS"),
    (PlantedBug("block-alignment", "    @classmethod\n"
                                   "    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:\n"
                                   "        return align_blocks_to_rows(spec)\n", ""),
     "its backend class declares no customize_spec"),
    (PlantedBug("adaptive-verification", "spec_config is not None and spec_config.enable_adaptive_verification",
                "False"),
     "reads adaptive verification; its builder reads no enable_adaptive_verification"),
)
#: Under adaptive verification, each row bounded by its request under the host's query split (the
#: path without adaptive verification) where 0.31.0 to 0.34.0 bound every row by the longest
#: request. Right wherever the device runs the host's split; caught only by a step whose device
#: split differs (``harness.cases.device_split_cases``, ``tests/cpu/test_query_split.py``, whose written
#: cases keep the host split: ``tests/cpu/test_vllm_dump_replay.py``). Not one of :data:`BUGS`: the
#: journeys' tests (:data:`scripts.gpu_journeys.VLLM_TESTS`) run no such step.
HOST_SPLIT_BOUND = PlantedBug("host-split-bound", "ctx = torch.full((num_rows,), int(sl_host[:num_reqs].max()))",
                              "ctx = self._row_contexts(qsl, sl_host[:num_reqs])")


def planted_copy(source_root: Path, to: Path, bug: PlantedBug) -> Path | None:
    """A copy of the release's files (``source_root``, a folder holding ``vllm/``) with ``bug``
    planted in its SM90 module, or None where the module does not hold the shipped line once."""
    shutil.copytree(source_root, to)
    module = to / MODULE_FILES[0]
    text = module.read_text()
    if text.count(bug.shipped) != 1:
        return None
    module.write_text(text.replace(bug.shipped, bug.planted))
    return to
