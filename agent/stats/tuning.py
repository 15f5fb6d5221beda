"""Launch shapes of the statistics kernels: constants chosen for the hardware, not settings."""

from __future__ import annotations

import os

# Triton's interpreter (TRITON_INTERPRET=1, read by Triton itself): kernels run on the CPU, for tests.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# The most elements per program of the standalone kernel (a multiple of 8; at most 16383 tiles: the bf16 words
# path counts in 16-bit halves); on the CPU, the chunk. On a GPU the launcher sizes chunks so that a launch is one
# wave of programs, one per slot (a program's place on an SM at the register cap): a partial last wave leaves most
# SMs idle, and set-up and merge are paid per program.
CHUNK = 1 << 20
NUM_WARPS = 8
ROWS = 512  # rows of a [ROWS, 16 bytes] tile: ROWS / (32 * NUM_WARPS) 16-byte loads per thread per iteration
# Register cap (ptxas): uncapped, the cold code (finalize, careful path, threshold bisection) takes most of the
# register file, one program per SM. 128 (two programs per SM) suits the bf16 words path, whose cold code spills at a
# lower cap; a launch of fp32 tensors only has less live state and runs best at MAXNREG_FP32 (three per SM).
MAXNREG = 128
MAXNREG_FP32 = 80
# The log2 histogram in a shared-memory table on hardware: fewer instructions per element than tl.histogram's
# ballots. The interpreter has no shared memory and counts with tl.histogram.
SMEM_HIST = not INTERPRET
P_BLOCK = 512  # partials the finalize step reads at once (2 per lane with 8 warps); more: blocks of this size
MAX_TENSORS = 4096  # per launch (the size of the per-device counter buffer)
MAX_LATER = 1024  # rows waiting for a later merge at most (their partials stay allocated): then merged at once
MAX_DEFERRED = 8  # deferred tensors waiting at most (kept alive until their launch): then a launch of their own
# Pinned and device int64 words per device for the tables of launches captured into CUDA graphs: a launch of T
# tensors takes 20*T words; 4 MiB holds the launches of a few graphs of a whole step.
CAPTURE_STAGING_WORDS = 1 << 19
