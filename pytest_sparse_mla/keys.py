"""Names of the properties tests attach to their reports (``node.user_properties``), shared by
the tests that write them and the plugin modules that sum them up."""

REGIME_KEY = "sparse_mla_regimes"  # rows checked per regime and the regimes the outcome credits
DECLARED_REGIMES_KEY = "sparse_mla_declared_regimes"  # the regimes a test covers, known before it runs
DECLARED_EDGES_KEY = "sparse_mla_declared_edges"  # the edge families a test belongs to (its edge markers)
LAUNCH_KEY = "sparse_mla_launch"  # the kernel launches a test made, and the plans refused as the release is expected to
REPLAY_KEY = "sparse_mla_replay"  # a replayed fixture's diagnostics text
DUMP_KEY = "sparse_mla_dump"  # a failing case written under --dump-failures: path, bytes, seconds
ERROR_KEY = "sparse_mla_kernel_error"  # a GPU case's measured error ratios
WARNING_KEY = "flashinfer_warnings"  # the FlashInfer warnings a test raised (attached at teardown)

GROUP = ("sparse-mla", "sparse MLA differential tester")  # the options' group in --help
