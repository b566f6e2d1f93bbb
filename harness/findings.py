"""The known production findings the suite keeps visible: the reason strings of its strict
xfails (and of the recorded fixtures that must keep showing a finding). A finding that gets
fixed turns its xfails into failures that ask for the marker to go."""

#: Regime C rows under the strided and packed layouts (format with ``layout=``).
REGIME_C_FINDING = (
    "SPEC §6 #3: pooled rows with ctx < topk and ctx % kpool != 0 (regime C) are not a prefix; "
    "the {layout} layout plans them as one"
)

#: A CUDA graph replayed after a plan whose cluster size differs from the captured one.
STALE_CLUSTER_FINDING = (
    "SPEC §6 #8 (stale plan state in a replay): FlashInfer's fa3 MLA plan picks cluster size 2 when "
    "rows * heads // max_rows > 64, else 1; a graph captured at the maximum size with heads > 64 and "
    "replayed after a plan with cluster size 1 does not compute the eager result"
)
