"""The compiler's cost constants: local compute on a CPU core, and the first data-parallel bucket.

SBP selection, gradient bucketing and the planner's default cpu profile price work with the same numbers.
"""

from __future__ import annotations

MEM_SECONDS_PER_BYTE = 1 / 20e9  # local compute: bytes through memory (a CPU core's stream bandwidth)
SECONDS_PER_FLOP = 1 / 50e9  # matmul throughput
FIRST_BUCKET = 1 << 20  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)
