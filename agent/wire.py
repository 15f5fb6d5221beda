"""The ingest wire contract shared by the agent and the monitor (docs/wire-format.md).

Only names and limits live here, so the monitor can import them without pulling in torch.
"""

WIRE_VERSION = 1

# Sent by the agent, `fp8mon sync` and the dashboard with every request that changes state. A cross-site HTML form
# cannot send a header of its own, and a cross-site script cannot without a CORS preflight, which the monitor never
# grants: the monitor refuses a state-changing request that carries neither this header nor a bearer token.
CLIENT_HEADER = "X-Fp8mon-Client"

# Names the server accepts; the agent checks them too, so one bad name cannot cost a whole batch.
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+/=-]*$"
SCALAR_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_./-]*$"
MAX_RUN_NAME = 200
MAX_LAYER_NAME = 300
MAX_SCALAR_NAME = 200
TAG_KEY_PATTERN = r"^[^\x00-\x1f\x7f=]*$"  # no control characters, no '=' (a tag filter is key=value)
TAG_VALUE_PATTERN = r"^[^\x00]*$"  # searched by value: PostgreSQL's text cannot hold NUL
MAX_TAG = 200

# Run identity (docs/wire-format.md, "Run identity"): a run's id, chosen by the agent or the user, and what a
# batch asks of a name or id the monitor may already have (W&B's resume modes).
RUN_ID_PATTERN = r"^[A-Za-z0-9_-]+$"
MAX_RUN_ID = 64
RESUME_MODES = ("allow", "must", "never")


def bad_path_segments(name: str) -> list[str]:
    """The '/'-segments of a name that travels in a URL path that are empty, '.' or '..': HTTP clients resolve them,
    so a run so named could never be fetched."""
    return [seg for seg in name.split("/") if seg in ("", ".", "..")]

SITES = ("input", "weight", "output", "grad_output", "grad_weight")

# Per-tensor statistics, in storage column order (SPEC section 4). `numel` is the element count the
# statistics were computed over; `amax_history_max` is the delayed-scaling history maximum.
TENSOR_STATS = (
    "numel",
    "amax",
    "rms",
    "mean",
    "std",
    "kurtosis",
    "kurtosis_central",
    "crest",
    "underflow_frac",
    "overflow_frac",
    "outlier_frac",
    "zero_frac",
    "nonfinite",
    "scale",
    "amax_history_max",
)

# log2 histogram of |x| per binade: bin i counts 2**(LOG2_HIST_LO + i) <= |x| < 2**(LOG2_HIST_LO + i + 1);
# the first bin also takes everything smaller (except exact zeros, which `zero_frac` counts), the last
# everything larger.
LOG2_HIST_LO = -40
LOG2_HIST_HI = 16
LOG2_HIST_BINS = LOG2_HIST_HI - LOG2_HIST_LO

WELL_KNOWN_SCALARS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "attn_max_logit",
    "logit_logsumexp",
    "adam_update_rms",
)
