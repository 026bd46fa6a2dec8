"""Pairwise (strength-2) test cases: every pair of values of any two factors appears in at least one case.

For parametrizations whose factors interact in pairs (an input kind with a dtype, a shape with a flag),
this covers each interaction with far fewer cases than the full product: 4 shapes x 3 kinds x 2 dtypes
take 12 cases instead of 24. Greedy and deterministic: the same factors always give the same cases, in
the product's order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def _pairs(case: tuple) -> set[tuple]:
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


def pairwise(*factors: Sequence) -> list[tuple]:
    """Cases (tuples, one value per factor) covering every pair of values of every two factors."""
    if len(factors) < 2:
        return [tuple(c) for c in itertools.product(*factors)]
    product = list(itertools.product(*factors))
    # values are compared by position, so unhashable values (dicts, tensors) work too
    indexed = list(itertools.product(*(range(len(f)) for f in factors)))
    todo = set().union(*(_pairs(c) for c in indexed))
    chosen = []
    while todo:
        best = max(range(len(indexed)), key=lambda k: (len(_pairs(indexed[k]) & todo), -k))
        todo -= _pairs(indexed[best])
        chosen.append(best)
    return [product[k] for k in sorted(chosen)]


def cpu_pairwise(*factors: Sequence) -> list[tuple]:
    """Every combination where a GPU runs the tests; every pair of values on a CPU, where each case runs the
    kernels in Triton's interpreter."""
    import torch

    return list(itertools.product(*factors)) if torch.cuda.is_available() else pairwise(*factors)
