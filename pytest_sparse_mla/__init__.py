"""The suite's pytest plugin, one module per job, each declaring its own options beside its
hooks. The root ``conftest.py`` loads it (``pytest_plugins = ("pytest_sparse_mla", ...)``);
no ``-p`` is needed.

- ``hypothesis_profiles``: the ``ci`` (default, derandomised) and ``thorough`` profiles;
- ``impl``: ``--impl`` and ``--device`` (the ``impl`` and ``device`` fixtures), GPU gating of
  ``gpu``-marked tests, the GPU-tier status in the header and summary, ``--require-gpu-tier``,
  the ``gpu_stand_in`` tests skipped where the GPU tier runs;
- ``baselines``: ``--record-baseline`` / ``--compare-baseline`` / ``--baseline-out`` /
  ``--baseline-fixtures`` / ``--baseline-timing``, the timing pass;
- ``replay``: ``--replay``, ``--dump-failures`` and the replay diagnostics;
- ``regimes``: the ``regime_log`` fixture, the ``regimes`` and ``edge`` markers, the summary per
  regime and per edge family;
- ``coverage``: ``--input-coverage``, the input-space coverage line and table
  (docs/input-space.md#measuring-coverage);
- ``gpus``: per-worker GPU pinning, the GPU each xdist
  worker used, and the kernel error-ratio and FlashInfer-warning summary (JSON too where ``SPARSE_MLA_GPU_REPORT`` names
  a file);
- ``vllm``: ``--vllm=PATH`` (a vLLM release's own SM90 backend under test, the ``vllm_backend``
  fixture, the ``vllm`` marker), the release in the header, the rows read back in the summary;
- ``backend``: ``--backend NAME|module:factory`` (the ``backend_under_test`` fixture: the backends
  the seam's tests run through, default the port on fa3 and fa2, the port with ``--impl``'s host
  stages);
- ``judge``: the ``judge`` fixture, the one place a step through a backend is judged and its
  verdict reported (regime table, twin counts, upgrade-check records), and the replay of a
  backend's written case;
- ``interpreter``: the ``interpreter`` marker (a CPU-tier test that hands Triton kernels CPU
  tensors runs in a child pytest under Triton's interpreter where the run's kernels are compiled);
- ``phases``: ``--profile-phases=FILE``, where the test time went per test module and phase
  (sampled);
- ``worker_load``: the tests dealt to the xdist workers heaviest first (``durations.json``), and
  the "xdist workers" section: per worker, its tests' seconds, when its first test started and
  its last one ended, and its longest tests (the run's critical path).

Hooks of the same kind run last-registered first, so the end-of-run lines come in the reverse
of this list: xdist workers, GPUs, input coverage, regimes, replay, upgrade report, then the implementation under test.
"""

pytest_plugins = [
    "pytest_sparse_mla.worker_load",
    "pytest_sparse_mla.phases",
    "pytest_sparse_mla.hypothesis_profiles",
    "pytest_sparse_mla.impl",
    "pytest_sparse_mla.baselines",
    "pytest_sparse_mla.replay",
    "pytest_sparse_mla.regimes",
    "pytest_sparse_mla.coverage",
    "pytest_sparse_mla.gpus",
    "pytest_sparse_mla.vllm",
    "pytest_sparse_mla.backend",
    "pytest_sparse_mla.interpreter",
    "pytest_sparse_mla.judge",
    "pytest_sparse_mla.flashmla_table",
]
