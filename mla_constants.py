"""The constants and names of sparse MLA that the packages share (no imports: safe anywhere).

``reference/``, ``fast/``, ``harness/``, ``recording/``, the pytest plugin, the benchmark and
the scripts import these instead of spelling them out.
"""

# --- shapes ---------------------------------------------------------------------------------

KV_LORA_RANK = 512  # the compressed KV (and absorbed q) width: q_nope, ckv and the output
ROPE_DIM = 64  # the rope part of q and of each cache row; 0 for NoPE
TOPK = 2048  # the indexer's top-k of DeepSeek-V3.2 / GLM DSA

# --- slot ids -------------------------------------------------------------------------------

INVALID = -1  # an indexer / convert entry that selects nothing
NULL_BLOCK_ID = 0  # the physical block the engine never allocates; padded requests' table rows hold it

# --- FlashInfer's fa3 scheduler ------------------------------------------------------------

#: Work items FlashInfer's fa3 MLA scheduler sizes its arrays for (``MLAPlan``'s
#: ``max_total_num_works`` in ``scheduler.cuh``): a plan of more goes past their end unless
#: plan() refuses it (docs/findings.md#plans-beyond-the-schedulers-work-capacity).
FA3_WORK_CAPACITY = 16384

# --- softmax scales -------------------------------------------------------------------------

DEEPSEEK_V32_SM_SCALE = 0.1352  # DeepSeek-V3.2 with YaRN mscale (rope 64)
GLM_NOPE_SM_SCALE = 256 ** -0.5  # GLM-5.3-Flash (NoPE)

# --- kernel variants (each JIT-builds separately in FlashInfer) -----------------------------

BF16_ROPE64 = "bf16-rope64"
FP8_ROPE64 = "fp8-rope64"
BF16_NOPE = "bf16-nope"
FP8_NOPE = "fp8-nope"

#: (kv dtype, rope, k_scale) of every variant the GPU tier launches: the regime cases cycle the
#: first three (``harness.cases.VARIANTS``); the drawn production inputs reach all four.
KERNEL_VARIANTS = (
    ("bfloat16", True, 1.0),
    ("float8_e4m3fn", True, 0.5),
    ("bfloat16", False, 1.0),
    ("float8_e4m3fn", False, 0.5),
)


#: The variants the GPU tier launches on FlashInfer's fa2 MLA kernel (the port on fa2: the regime
#: cases' three variants), as a cold 0.7.4 run's JIT build log lists them.
FA2_KERNEL_VARIANTS = KERNEL_VARIANTS[:3]


def variant_name(kv_dtype: str, rope: bool) -> str:
    """``bf16-rope64``, ``fp8-rope64``, ``bf16-nope`` or ``fp8-nope``."""
    return f"{'fp8' if kv_dtype == 'float8_e4m3fn' else 'bf16'}-{'rope64' if rope else 'nope'}"


# --- the implementation under test ------------------------------------------------------------

#: ``--impl``'s default: the project's production path (``fast/``).
DEFAULT_IMPL_SPEC = "fast.impl:default_impl"

# --- where the GPU tier runs ---------------------------------------------------------------

#: The environment variable naming the torch device the GPU tier's tests run on: ``cuda`` unless
#: set (the simulated SM90 machine, and a scale or plan-limit child on it, set ``cpu``).
GPU_TIER_DEVICE_ENV = "SPARSE_MLA_DEVICE"
GPU_TIER_DEFAULT_DEVICE = "cuda"

#: What a packing layout writes for a -1 inside a row's planned length (``reference.contract``'s
#: fillers; a vLLM release's ``minus_one_filler``, ``backends.vllm.facts``).
SLOT_ZERO = "slot 0"
FIRST_SLOT = "the row's first slot"
