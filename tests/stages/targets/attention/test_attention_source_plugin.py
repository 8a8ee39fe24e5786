"""A new attention source is one registered class (issue 33): this module adds one, ``rows_test``, and runs it
through stage one, ``inspect``, ``verify``, stage two and eval without touching any other file.

``rows_test`` stores what ``qk`` stores under its own name (its class holds a storage layout of that name, which
registering the source registers) and says so
in its own words in ``kdcache inspect``. Were any file to compare source names, the new name would take another
source's branch there (or be refused), and one of these steps would fail or report another source.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.targets import attention as attention_sources
from kdcache.stages.targets.attention.qk import QK
from kdcache.stages.train.logging import read_jsonl
from kdcache.storage import QK_LAYOUT, AttentionLayout
from tests.helpers.tiny_models import make_tiny_llama
from tests.stages.train._train_support import make_student_config, precompute_cache

NAME = "rows_test"


def _register() -> None:
    if NAME in attention_sources.names():
        return
    @attention_sources.register
    class RowsTest(QK):
        layout = AttentionLayout(NAME, QK_LAYOUT.kinds, token_rows=True)
        summary = "a test's queries and keys"

        def describe(self, info: dict) -> str:
            return f", rows of the test source ({info['attention_scores']['num_heads']} heads)"


_register()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rows-test")
    teacher = make_tiny_llama(root / "teacher", layers=2, hidden=32, heads=4, kv_heads=2)
    cache = precompute_cache(teacher, root / "cache", num_sequences=8,
                             extra=("--features", "hidden,attention,logits", "--top-k", "4", "--layers", "1,2",
                                    "--attention-source", NAME))
    student = make_student_config(root / "student", teacher, num_hidden_layers=2, hidden_size=16,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    return {"root": root, "cache": cache, "student": student, "teacher": teacher}


def test_the_flag_offers_the_new_source() -> None:
    from kdcache.stages.common.option_groups import leaves
    from kdcache.stages.precompute.core.options import PrecomputeOptions

    # the flag's choices are the registry's live names, whenever the family's flags were imported
    flag = next(f for _, _, f in leaves(PrecomputeOptions) if f.name == "attention_source")
    assert NAME in flag.metadata["choices"]


def test_stage_one_writes_the_new_source_and_inspect_and_verify_read_it(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((setup["cache"] / "manifest.json").read_text())
    assert manifest["spec"]["attention_source"] == NAME
    assert manifest["fingerprints"]["settings"]["attention_source"] == NAME
    assert {"attention_q/1", "attention_k/2"} <= set(manifest["arrays"])
    assert not any(name.startswith("attention/") for name in manifest["arrays"])
    capsys.readouterr()
    assert main(["inspect", str(setup["cache"])]) == 0
    assert ", rows of the test source (4 heads)" in capsys.readouterr().out
    assert main(["verify", str(setup["cache"])]) == 0


def test_stage_two_trains_and_eval_reports_the_new_source(setup: dict[str, Path]) -> None:
    run = setup["root"] / "run"
    assert main(["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--out", str(run),
                 "--zero-stage", "0", "--max-steps", "2", "--batch-size", "4", "--lr", "3e-3", "--delta", "1",
                 "--log-every", "1", "--json"]) == 0
    records = read_jsonl(run / "metrics.jsonl")
    assert len(records) == 2 and all(r["attention"] > 0 for r in records)
    from kdcache.stages.train.evaluation.evaluate import evaluate_run
    from kdcache.storage import CacheReader

    attention = evaluate_run(run, CacheReader(setup["cache"]), batch_size=4)["attention"]
    assert attention["source"] == NAME and set(attention["pairs"]) == {"s1_t1", "s2_t2"}
    assert all(value > 0 for value in attention["pairs"].values())
