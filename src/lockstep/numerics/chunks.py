"""Cache-sized chunks for chains of elementwise ops.

A chain of whole-tensor elementwise ops (silu_mul's ten passes in fp32, AdamW's twelve) streams
every intermediate through main memory and allocates a full-size temporary per op. Run on
consecutive chunks of about CHUNK_ELEMENTS elements, the intermediates stay in the L2 cache. The
ops lockstep chains agree in their vectorised and scalar loops (ADR 0001), so an element gets the
same bits wherever a chunk boundary falls: chunking is a speed choice, not part of the contract
(tests/test_chunks.py checks the bits against the unchunked chain).
"""

from __future__ import annotations

from typing import Iterator

# 128K elements: 512 KiB per fp32 intermediate, so a chain's few live intermediates fit the L2 of
# the CPUs we measure (1 MiB per core on the AMD EPYC of docs/benchmarks.md). Chunks much smaller
# than this pay Python dispatch per op; much larger ones spill to L3.
CHUNK_ELEMENTS = 1 << 17


def row_chunks(rows: int, width: int, elements: int | None = None) -> Iterator[tuple[int, int]]:
    """Consecutive row ranges [start, stop) covering `rows` rows of `width` elements each, about
    `elements` (default CHUNK_ELEMENTS) elements per range, at least one row. Yields nothing for
    rows == 0."""
    step = max(1, (CHUNK_ELEMENTS if elements is None else elements) // max(width, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)
