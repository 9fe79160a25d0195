"""The conformance suite kills every broken variant of the in-memory references (``mutants.py``): a
variant that passes it is a blind spot of the suite, which a backend with that defect would pass too."""

from __future__ import annotations

from tests.conformance import mutants


def test_every_broken_variant_fails_the_suite() -> None:
    killed = mutants.run()
    assert set(killed) == {m.__name__ for m in (*mutants.STORE_MUTANTS, *mutants.INDEX_MUTANTS)}
    survivors = [variant for variant, tests in killed.items() if not tests]
    assert survivors == [], f"the suite passed these broken variants: {survivors}"
