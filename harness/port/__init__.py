"""The studies of the port's own state: the modules of harness/ that drive the project's port
through its API, ``backends.flashinfer.port`` (its attention state, graphs, kept plans, scale and plan
limits), and the only ones of harness/ that may import it (``tests/cpu/test_layering.py``).

- :mod:`.launch`: what the GPU tests of the port's state drive it with (config, static inputs,
  NaN buffers, the plan or the expected refusal, the state against the as-planned selection);
- :mod:`.sequence`: multi-step sequences run through carried state;
- :mod:`.scale`: the scale edge's cases, each in a child process (``python3 -m harness.port.scale``);
- :mod:`.plan_limits_child`: one child of the plan-limit search (:mod:`harness.plan_limits`);
- :mod:`.prebuild`: every JIT kernel variant built once (``python3 -m harness.port.prebuild``);
- :mod:`.full_width_strided`: the full-width strided launch in its own process.

Nothing is imported here, so ``python3 -m harness.port.<module>`` runs one module alone.
"""
