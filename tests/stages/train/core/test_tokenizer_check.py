"""The cache's tokenizer against the student's (``checks.tokenizer_problems``): compared only where both hashes are
there and of one kind, then one sentence naming both vocabularies."""

from __future__ import annotations

import pytest

from kdcache.stages.train.core.checks import tokenizer_problems

HASH_A, HASH_B = "sha256:" + "a" * 64, "sha256:" + "b" * 64


@pytest.mark.parametrize(("cached", "student"), [
    ({"vocab_hash": None, "vocab_size": 5}, {"vocab_hash": None, "vocab_size": 6}),  # no hash on either side
    ({"vocab_size": 5}, {"vocab_hash": HASH_B, "vocab_size": 6}),  # none recorded in the cache
    ({"vocab_hash": HASH_A, "vocab_size": 5}, {"vocab_hash": None, "vocab_size": 6}),  # none for the student
    ({"vocab_hash": HASH_A, "vocab_size": 5}, {"vocab_hash": "b" * 64, "vocab_size": 6}),  # another hash helper
    ({"vocab_hash": HASH_A, "vocab_size": 5}, None),  # no student tokenizer
])
def test_hashes_that_cannot_be_compared_give_no_problem(cached: dict, student: dict | None) -> None:
    assert tokenizer_problems(cached, student) == []


def test_two_vocabularies_are_named_with_their_sizes() -> None:
    problems = tokenizer_problems({"vocab_hash": HASH_A, "vocab_size": 5}, {"vocab_hash": HASH_B, "vocab_size": 6})
    assert len(problems) == 1 and "a vocabulary of 5 tokens" in problems[0] and "expects 6" in problems[0], problems
    assert tokenizer_problems({"vocab_hash": HASH_A, "vocab_size": 5}, {"vocab_hash": HASH_A, "vocab_size": 5}) == []
