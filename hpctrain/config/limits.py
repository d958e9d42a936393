"""Upper bounds of every job.yaml number and list, in one place, each with its reason.

Every input has a size and a range: a value past these is a typo or an attack, and without a bound
it reaches code that loops, allocates or multiplies by it (`model.layers: 2**70` hung `plan`).
The bounds sit one or more orders of magnitude above the largest real jobs, so no honest job meets them;
the planner and the runtime then only ever see ordinary numbers.
"""

from __future__ import annotations

# The model. Largest published shapes (2024): ~130 layers, hidden 25,600, 128 heads, vocab 256k,
# contexts of 1-10M tokens; DeepNet trained 1,000 layers (Wang et al. 2022).
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 18  # 262,144
MAX_HEADS = 4096
MAX_FFN_HIDDEN = 1 << 20
MAX_VOCAB = 1 << 24  # 16.7M tokens
MAX_SEQ_LEN = 1 << 24  # 16.7M tokens
MAX_ROPE_THETA = 1e12  # Llama 3 uses 5e5; long-context variants stay below 1e9

# The cluster: cluster.nodes <= 100,000 and gpus_per_node <= 64 (config/infra.py).
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 64
MAX_WORLD = MAX_NODES * MAX_GPUS_PER_NODE
MAX_GPU_MEMORY_GIB = 65_536.0  # 64 TiB per device; today's largest is 288 GiB
MAX_GPU_TFLOPS = 1e6  # 1 EFLOP/s per device; today's largest dense bf16 is ~2,500
MAX_LINK_GBPS = 1e5  # 100 TB/s per GPU; NVLink 5 is 900 GB/s

# Training. A step count of 10^9 is ~30 years at one step per second.
MAX_STEPS = 10**9
MAX_GLOBAL_BATCH = 1 << 24
MAX_MICRO_BATCH = 1 << 20
MAX_SEED = 2**63 - 1  # torch.manual_seed takes up to 2**64 - 1; headroom for seed + rank
MAX_CHECKPOINTS_KEPT = 10_000

# Lists and strings that are not free text.
MAX_LIST_ITEMS = 1_000  # setup lines, binds, pip and apt packages: a page each is plenty
MAX_NAME_CHARS = 128  # catalog names (gpu, node, fabric)
MAX_SECONDS = 10**7  # ~115 days: any interval or delay

# A sweep: Slurm's default MaxArraySize is 1,001; 10,000 points is already a cluster-week of jobs,
# and the planner resolves each one on the login node.
MAX_GRID_POINTS = 10_000
MAX_GRID_KEYS = 64


def out_of_bounds(value: object, metadata: list[object]) -> str | None:
    """Why `value` breaks a pydantic Field's bounds (its `metadata`: annotated_types Ge/Gt/Le/Lt), else None.

    The one check for a number that does not come through job.yaml's own validation: values taken from
    `model.init_from`'s config.json or a data sidecar meet the same bounds the schema gives the field.
    A float must be finite (Python's json reads `Infinity` and `NaN`).
    """
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    for bound in metadata:
        for attr, ok, words in (("ge", lambda v, b: v >= b, "at least"), ("gt", lambda v, b: v > b, "above"),
                                ("le", lambda v, b: v <= b, "at most"), ("lt", lambda v, b: v < b, "below")):
            limit = getattr(bound, attr, None)
            if limit is not None and not ok(value, limit):
                return f"must be {words} {limit}"
    return None
