"""The pairwise case generator the kernel tests parametrize with (tests/pairwise.py)."""

import itertools

from pairwise import pairwise


def _covers_every_pair(cases, factors):
    for (i, fi), (j, fj) in itertools.combinations(enumerate(factors), 2):
        for a, b in itertools.product(range(len(fi)), range(len(fj))):
            if not any(c[i] is fi[a] and c[j] is fj[b] for c in cases):
                return False
    return True


def test_every_pair_is_covered_with_fewer_cases_than_the_product():
    shapes, kinds, dtypes = [(16, 32), (48, 64), (7, 16), (64, 128)], ["normal", "heavy", "adversarial"], ["bf16", "f32"]
    cases = pairwise(shapes, kinds, dtypes)
    assert _covers_every_pair(cases, (shapes, kinds, dtypes))
    assert len(cases) == 12 and len(set(cases)) == 12  # 4 x 3 is the least any pairwise set can have
    assert cases == pairwise(shapes, kinds, dtypes)  # deterministic
    big = [list(range(3))] * 5  # 3^5 = 243 cases; a pairwise set needs at least 9
    small = pairwise(*big)
    assert _covers_every_pair(small, big) and 9 <= len(small) <= 20


def test_one_factor_or_unhashable_values_give_every_case():
    assert pairwise(["a", "b"]) == [("a",), ("b",)]
    dicts = [{"k": 1}, {"k": 2}]
    cases = pairwise(dicts, [True, False])
    assert len(cases) == 4 and _covers_every_pair(cases, (dicts, [True, False]))
