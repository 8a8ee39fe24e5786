"""English sentences from Python's standard-library docstrings: real text with no download.

The demo (and the benchmarks) need a few thousand natural sentences on a machine without dataset hubs. The
standard library's docstrings are English prose written by people, and every Python install has them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path

# A fixed list keeps the corpus (and so the demo's cache fingerprint) the same from run to run.
MODULES = (
    "abc argparse ast asyncio base64 bisect calendar cmd codecs collections concurrent.futures configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis doctest email enum fileinput fnmatch "
    "fractions ftplib functools getopt gettext glob gzip hashlib heapq hmac html html.parser http.client "
    "http.server imaplib inspect io ipaddress itertools json logging lzma mailbox mimetypes multiprocessing "
    "numbers operator optparse os pathlib pdb pickle pkgutil platform plistlib poplib pprint profile pstats "
    "queue quopri random re reprlib sched secrets selectors shelve shlex shutil signal smtplib socket "
    "socketserver sqlite3 ssl statistics string struct subprocess symtable tarfile tempfile textwrap "
    "threading timeit tokenize trace traceback types typing unittest urllib.parse urllib.request uuid "
    "warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zoneinfo"
).split()

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODEY = re.compile(r"[{}\[\]=<>]|>>>|\w\(|\)\.|__|\.py\b|::")


def _docstrings(module_name: str) -> Iterator[str]:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a module missing from a minimal Python build is simply skipped
        return
    yield inspect.getdoc(module) or ""
    for _, obj in sorted(vars(module).items()):
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == module_name:
            yield inspect.getdoc(obj) or ""
            if inspect.isclass(obj):
                for _, member in sorted(vars(obj).items()):
                    if inspect.isfunction(member):
                        yield inspect.getdoc(member) or ""


def _sentences(doc: str) -> Iterator[str]:
    # Paragraphs first: docstrings wrap lines, and a blank line ends a thought.
    for paragraph in re.split(r"\n\s*\n", doc):
        text = " ".join(paragraph.split())
        for sentence in _SENTENCE_END.split(text):
            if 40 <= len(sentence) <= 240 and sentence[0].isupper() and sentence[-1] in ".!?" \
                    and not _CODEY.search(sentence):
                yield sentence


def stdlib_sentences(limit: int | None = None) -> list[str]:
    """Unique English sentences from stdlib docstrings, in a fixed order: at most ``limit``, each of 40-240
    characters and looking like prose, not code."""
    seen: dict[str, None] = {}
    for name in MODULES:
        for doc in _docstrings(name):
            for sentence in _sentences(doc):
                seen.setdefault(sentence, None)
                if limit is not None and len(seen) >= limit:
                    return list(seen)
    return list(seen)


def jsonl_text(sentences: list[str], column: str = "text") -> str:
    """One ``{column: sentence}`` object per line, the format ``datasets`` loads as ``json``."""
    return "".join(json.dumps({column: sentence}) + "\n" for sentence in sentences)


def write_jsonl(sentences: list[str], path: str | Path, column: str = "text") -> Path:
    """Write ``jsonl_text`` of the sentences to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = jsonl_text(sentences, column)
    # The same file is left as it is: its rows (keyed on the file's time too) and caches stay reusable.
    if not (path.is_file() and path.read_text() == text):
        path.write_text(text)
    return path
