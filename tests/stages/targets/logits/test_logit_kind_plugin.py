"""A new logit kind is one registered class (issue 33): this module adds one, ``topk_test``, and runs it through
stage one, ``inspect``, ``verify``, stage two and eval without touching any other file.

``topk_test`` stores what ``topk`` stores under its own name (its class holds a storage layout of that name, with
the same arrays, which registering the kind registers), logs its stage-two term under its own name, labels eval's
KL in its own words and describes itself in its own words in ``kdcache inspect``. Were any file to compare mode names, or to pick the kind by its arrays rather
than by the cache's mode, the new name would take ``topk``'s branch there (or be refused), and one of these steps
would fail or report ``topk``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.targets import logits as logit_kinds
from kdcache.stages.targets.logits import base as kinds_base
from kdcache.stages.targets.logits.topk import TopK
from kdcache.stages.train.logging import read_jsonl
from kdcache.storage import TOPK_LAYOUT as TOPK
from kdcache.storage.core.logit_layouts import LAYOUTS, LogitLayout
from tests.helpers.tiny_models import make_tiny_llama
from tests.stages.train._train_support import make_student_config, precompute_cache

pytestmark = pytest.mark.slow

NAME = "topk_test"
TERM = "topk_test_kl"
KL_FORM = "a test's top-k + other bucket"


class TopKTest(TopK):
    """``topk``'s capture and loss under a name, a term, an eval label and an ``inspect`` line of its own."""

    layout = LogitLayout(NAME, TOPK.arrays, TOPK.validate, logprob=TOPK.logprob, file_sparse=TOPK.file_sparse)
    term = TERM
    kl_form = KL_FORM

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"the test's own top-{info['top_k']} (V={info['vocab_size']})"


@pytest.fixture(scope="module")
def registered() -> Iterator[None]:
    """The kind with its layout, registered for this module only (other tests list the built-in modes)."""
    logit_kinds.register(TopKTest)
    yield
    del kinds_base._KINDS[NAME]
    del LAYOUTS[NAME]


@pytest.fixture(scope="module")
def setup(registered: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("topk-test")
    teacher = make_tiny_llama(root / "teacher", layers=2, hidden=32, heads=4, kv_heads=2)
    cache = precompute_cache(teacher, root / "cache", num_sequences=8,
                             extra=("--features", "hidden,logits", "--logits", NAME, "--top-k", "4",
                                    "--layers", "1,2"))
    student = make_student_config(root / "student", teacher, num_hidden_layers=2, hidden_size=16,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    return {"root": root, "cache": cache, "student": student, "teacher": teacher}


def test_the_registry_parses_the_new_mode(registered: None) -> None:
    kind, argument = logit_kinds.parse(NAME)
    assert isinstance(kind, TopKTest) and argument == 0
    assert NAME in logit_kinds.usage()


def test_stage_one_writes_the_new_mode_and_inspect_and_verify_read_it(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((setup["cache"] / "manifest.json").read_text())
    assert manifest["spec"]["logits"] == NAME and manifest["spec"]["top_k"] == 4
    assert {"logits/topk_values", "logits/topk_ids", "logits/lse"} <= set(manifest["arrays"])
    capsys.readouterr()
    assert main(["inspect", str(setup["cache"])]) == 0
    vocab = manifest["spec"]["vocab_size"]
    assert f"the test's own top-4 (V={vocab})" in capsys.readouterr().out
    assert main(["verify", str(setup["cache"])]) == 0


def test_stage_two_logs_the_new_term_and_eval_labels_its_kl(setup: dict[str, Path]) -> None:
    run = setup["root"] / "run"
    assert main(["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--out", str(run),
                 "--zero-stage", "0", "--max-steps", "2", "--batch-size", "4", "--lr", "3e-3",
                 "--log-every", "1", "--json"]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    assert len(records) == 2
    assert all(r[TERM] > 0 and math.isfinite(r[TERM]) for r in records)
    assert not any("topk_kl" in r for r in records)  # the built-in kind's term is not what ran
    from kdcache.stages.train.evaluation.evaluate import evaluate_run
    from kdcache.storage import CacheReader

    lm = evaluate_run(run, CacheReader(setup["cache"]), batch_size=4)
    assert lm["kl_form"] == KL_FORM and lm["kl"] > 0 and 0 <= lm["top1_agreement"] <= 1
