"""Fingerprint helpers: stable hashes, and plain-words comparison of two fingerprint dicts.

A fingerprint is a nested JSON dict (``teacher``, ``tokenizer``, ``data``, ``settings``; see
docs/architecture.md). Hashes are ``sha256:`` hex strings so a user can recompute them with any tool.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import numpy as np

_SECTION_WORDS = {"teacher": "teacher", "tokenizer": "tokenizer", "data": "data", "settings": "setting"}


def hash_bytes(data: bytes | memoryview) -> str:
    """``sha256:<hex>`` of raw bytes."""
    digest = StreamHash()
    digest.update(data)
    return digest.hexdigest()


def hash_json(obj: object) -> str:
    """Hash of canonical JSON (sorted keys, no spaces), e.g. for a model config dict."""
    return hash_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


class StreamHash:
    """``hash_bytes`` fed piece by piece (a model's weight files, block by block): the one place a fingerprint's
    ``sha256:<hex>`` form is made, for storage and the stages alike."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
        """Add ``data`` after everything so far."""
        self._digest.update(data)

    def hexdigest(self) -> str:
        """``sha256:<hex>`` of every byte so far."""
        return "sha256:" + self._digest.hexdigest()


class ArraysHash:
    """``hash_arrays`` fed one array at a time, so a long sequence of arrays is hashed as it streams past."""

    def __init__(self) -> None:
        self._digest = StreamHash()

    def update(self, array: np.ndarray) -> None:
        # The length goes first, so ``[1, 2], [3]`` and ``[1], [2, 3]`` hash differently.
        array = np.ascontiguousarray(array, dtype=np.int64)
        self._digest.update(np.int64(array.size).tobytes())
        self._digest.update(array.data)

    def hexdigest(self) -> str:
        """``sha256:<hex>`` of every array so far."""
        return self._digest.hexdigest()


def hash_arrays(arrays: Iterable[np.ndarray]) -> str:
    """One hash over a sequence of arrays, e.g. the ``input_ids`` of every sequence in order (``ArraysHash``)."""
    digest = ArraysHash()
    for array in arrays:
        digest.update(array)
    return digest.hexdigest()


def _short(value: object) -> str:
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[7:19] + ".."
    return json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else repr(value)


def _vocab_message(actual: dict[str, Any], expected: dict[str, Any]) -> str:
    # A size that was not recorded is left out rather than printed as a placeholder.
    built = f"a vocabulary of {actual['vocab_size']} tokens" if "vocab_size" in actual else "a vocabulary"
    wanted = f"{expected['vocab_size']} " if "vocab_size" in expected else "another vocabulary "
    return (f"tokenizer vocab differs: the cache was built with {built} (hash {_short(actual.get('vocab_hash'))}), "
            f"the student expects {wanted}(hash {_short(expected.get('vocab_hash'))})")


def _special_tokens_message(actual: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(actual) | set(expected)):
        if actual.get(key) != expected.get(key):
            out.append(f"tokenizer special token {key} differs: {_short(actual.get(key))} in the cache, "
                       f"{_short(expected.get(key))} expected")
    return out


# Keys that name where a thing was found, not what it is: a data file's path, a teacher's folder. Where both
# fingerprints of the section record a content hash of the same name (``input_ids_hash``, ``weights_hash``...),
# the content decides and the label may differ, so a copied or moved cache and data folder is the same cache.
_LABELS = {"data": "source", "teacher": "name_or_path"}


def _labels_only(section: str, actual: dict[str, Any], expected: dict[str, Any]) -> set[str]:
    """The label keys of ``section`` that its content hashes make irrelevant (empty without a shared hash)."""
    hashes = [k for k in expected if k.endswith("_hash") and None not in (expected[k], actual.get(k))]
    return {_LABELS[section]} if section in _LABELS and hashes else set()


Difference = tuple[str, object, object]  # (sentence, the cache's value, the expected value)


def _compare(actual: object, expected: object, path: list[str], strict: bool, out: list[Difference]) -> None:
    label = " ".join([_SECTION_WORDS.get(path[0], path[0])] + path[1:]) if path else "fingerprints"
    if isinstance(actual, dict) and isinstance(expected, dict):
        if len(path) == 1:
            labels = _labels_only(path[0], actual, expected)
            actual = {k: v for k, v in actual.items() if k not in labels}
            expected = {k: v for k, v in expected.items() if k not in labels}
        if path == ["tokenizer"] and ("vocab_hash" in expected or "vocab_size" in expected) and any(
            k in expected and actual.get(k) != expected[k] for k in ("vocab_hash", "vocab_size")
        ):
            out.append((_vocab_message(actual, expected), None, None))
            actual = {k: v for k, v in actual.items() if k not in ("vocab_hash", "vocab_size")}
            expected = {k: v for k, v in expected.items() if k not in ("vocab_hash", "vocab_size")}
        if path == ["tokenizer", "special_tokens"]:
            out.extend((message, None, None) for message in _special_tokens_message(actual, expected))
            return
        keys = sorted(set(expected) | (set(actual) if strict else set()))
        for key in keys:
            what = f"{label} {key}" if path else f"the {key} fingerprint"
            if key not in actual:
                out.append((f"{what} is not recorded in the cache; expected {_short(expected[key])}", None, None))
            elif key not in expected:
                out.append((f"{what} is recorded in the cache as {_short(actual[key])} but not given now", None,
                            None))
            else:
                _compare(actual[key], expected[key], path + [key], strict, out)
    elif actual != expected and expected is not None:
        out.append((f"{label} differs: the cache has {_short(actual)}, expected {_short(expected)}", actual,
                    expected))


def compare_fingerprints(actual: dict[str, Any], expected: dict[str, Any], *, strict: bool = False) -> list[str]:
    """Explain every difference between a cache's fingerprints and what a consumer expects.

    Args:
        actual: the cache's fingerprints (``reader.fingerprints``).
        expected: what the consumer (the student, a resuming writer) expects. Keys it leaves out, and values
            of None, are not checked, so a student may check only the tokenizer.
        strict: also report keys recorded in the cache but absent from ``expected``.

    A section's label (the data's ``source`` path, the teacher's ``name_or_path``) is compared only where the
    section records no content hash on both sides: the hashes of the rows and of the weights say what the data
    and the teacher are, wherever they lie.

    Returns:
        One plain-words sentence per mismatch; empty when they agree.
    """
    return [sentence for sentence, _, _ in fingerprint_differences(actual, expected, strict=strict)]


def fingerprint_differences(actual: dict[str, Any], expected: dict[str, Any], *,
                            strict: bool = False) -> list[Difference]:
    """``compare_fingerprints``' sentences with the two values each compares (None for a sentence about a
    missing key or the tokenizer), so that a caller can leave out what another check already said."""
    out: list[Difference] = []
    _compare(actual, expected, [], strict, out)
    return out


def same_values(a: object, b: object) -> bool:
    """Whether two values read the same in JSON (a tuple and a list of the same items do)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
