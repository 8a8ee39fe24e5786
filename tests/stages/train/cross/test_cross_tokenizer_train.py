"""``kdcache train --cross-tokenizer`` end to end on the CPU (issue 35): a tiny Llama teacher's cache (BPE, with
``--record-text``) trains a tiny Llama student with a WordPiece tokenizer; a cache without texts is refused with a
clear message, and without the option another tokenizer is refused as before. ``kdcache eval`` scores such runs
(and their baselines) span by span against references written here from the formulas, a run without a layer map
on the uniform map, and ``kdcache report`` shows the span columns.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.train.cross.cross_model import CrossDistillModel, SpanAligner, build_cross_model, without_logit_kl
from kdcache.stages.train.logging import read_jsonl
from tests.helpers.tiny_models import make_tiny_llama, train_wordpiece_tokenizer
from tests.stages.train._train_support import precompute_cache

STEPS = 6
pytestmark = pytest.mark.slow  # end to end: stage one twice and DeepSpeed runs


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("cross")
    teacher = make_tiny_llama(root / "teacher", layers=2, hidden=32)
    features = ("--features", "hidden,logits", "--layers", "0,2", "--top-k", "8")
    cache = precompute_cache(teacher, root / "cache", num_sequences=16, extra=(*features, "--record-text"))
    old = precompute_cache(teacher, root / "old", num_sequences=8, extra=features)
    student = root / "student"
    tok = train_wordpiece_tokenizer(student, vocab_size=150)
    LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128,
                pad_token_id=tok.pad_token_id).save_pretrained(str(student))
    return {"root": root, "cache": cache, "old": old, "student": student}


def _argv(setup: dict[str, Path], cache: str, out: str, *extra: str) -> list[str]:
    return ["train", "--cache", str(setup[cache]), "--student", str(setup["student"]), "--out",
            str(setup["root"] / out), "--max-steps", str(STEPS), "--batch-size", "4", "--lr", "3e-3",
            "--log-every", "1", "--layer-map", "explicit:1-2", "--json", *extra]


def test_a_student_with_another_tokenizer_trains(setup: dict[str, Path]) -> None:
    # one DataLoader worker: the student's tokens are made there (the aligner travels to it)
    assert main(_argv(setup, "cache", "gold", "--cross-tokenizer", "--num-workers", "1")) == 0
    rows = read_jsonl(setup["root"] / "gold" / "metrics.jsonl")
    assert len(rows) == STEPS
    for key in ("ce", "gold", "hidden", "aligned_share"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in rows), key
    assert 0 < rows[0]["aligned_share"] < 1  # WordPiece and byte-level BPE split differently
    assert (setup["root"] / "gold" / "student" / "config.json").is_file()


def test_the_cross_step_reads_nothing_back(setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The student's tokens come with the batch (made in the reader) and the span losses weigh rows instead of
    selecting them: no host read of a device value inside a micro-step between log steps. The syncs by size are
    the two vocabulary passes' indexes of their valid rows (CE on the student's tokens, the span KL), one each."""
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.loop import run_training
    from tests.helpers.sync_counter import SyncCounter

    counter = SyncCounter(monkeypatch)
    options = TrainOptions.of(cache=str(setup["cache"]), student=str(setup["student"]),
                              out=str(setup["root"] / "nosync"), batch_size=4, lr=3e-3, log_every=4, max_steps=4,
                              layer_map=["explicit:1-2"], cross_tokenizer="gold", export=False)
    assert run_training(options)["steps"] == 4
    assert counter.micro_steps == 4 and len(counter.calls) == 2 * 3, counter.calls
    assert {call.split(":")[0] for call in counter.calls} == {"stages/targets/logits/vocab/vocab_pass.py"}, counter.calls


def test_span_agreement_of_the_run_and_of_an_untrained_student(setup: dict[str, Path]) -> None:
    from kdcache.stages.train.evaluation.span_eval import evaluate_spans
    from kdcache.storage import CacheReader

    reader = CacheReader(setup["cache"])
    run = setup["root"] / "gold"
    trained = evaluate_spans(run, reader, batch_size=3)
    untrained = evaluate_spans(run, reader, student=setup["student"], batch_size=5)
    assert trained["spans"] == untrained["spans"] > 0 and 0 < trained["aligned_share"] < 1
    assert set(trained["span_cka"]) == {"s1_t2"} and 0 <= trained["span_cka"]["s1_t2"] <= 1
    assert -1 <= trained["span_cosine"]["s1_t2"] <= 1  # through the run's projector (16 -> 32)
    assert untrained["span_cosine"] == {}  # 16 -> 32 and no trained projector: not measurable
    agree, spans, cka, teacher_words = _reference(setup, setup["student"], (1, 2))
    assert untrained["spans"] == spans
    assert untrained["span_top1"] == pytest.approx(agree / spans)
    assert untrained["span_top1_floor"] == pytest.approx(max(teacher_words.values()) / spans)
    assert untrained["span_cka"]["s1_t2"] == pytest.approx(cka, abs=1e-4)




def _word(tokenizer: Any, token: int) -> tuple[str, str]:
    """The rule of span top-1, written again: case-folded, without surrounding spaces or "##", blank is " "; a
    piece of a character (decoded to U+FFFD) is its vocabulary string."""
    decoded = tokenizer.decode([token])
    if "\ufffd" in decoded:
        return ("piece", tokenizer.convert_ids_to_tokens(token))
    word = decoded.strip().lower()
    return ("text", (word[2:] if word.startswith("##") else word) or " ")


def _reference(setup: dict[str, Path], student: Path,
               pair: tuple[int, int]) -> tuple[int, int, float, Counter[tuple[str, str]]]:
    """(agreeing spans, spans, linear CKA of the span-pooled states of ``pair``, the teacher's next texts counted
    over the spans) of ``student`` on the cache,
    sequence by sequence from the formulas. Plain text trains every token, so every span counts (the teacher's KL
    counts a row's last token too: it predicts from the teacher's cached distribution)."""
    from transformers import AutoTokenizer

    from kdcache.stages.common.cache_texts import read_texts
    from kdcache.stages.train.core.student import load_student
    from kdcache.stages.train.cross.align import align, student_ends
    from kdcache.storage import CacheReader

    reader = CacheReader(setup["cache"])
    model = load_student(student, seed=0).eval()
    s_tok, t_tok = AutoTokenizer.from_pretrained(str(student)), AutoTokenizer.from_pretrained(
        str(setup["cache"] / "tokenizer"))
    texts, agree, spans, pooled = read_texts(reader.store), 0, 0, []
    teacher_words: Counter[tuple[str, str]] = Counter()
    for i in range(len(reader)):
        ids, ends = student_ends(s_tok, texts.texts[i], max_length=128)
        a = align(texts.ends[i], ends)
        with torch.no_grad():
            out = model(torch.as_tensor(ids)[None], output_hidden_states=True)
        row = reader[i]
        t_ids, h_t = row["logits/topk_ids"][:, 0], torch.as_tensor(row[f"hidden/{pair[1]}"]).double()
        for k, (t, s) in enumerate(zip(a.last("teacher"), a.last("student"))):
            spans += 1
            word = _word(t_tok, int(t_ids[t]))
            agree += word == _word(s_tok, int(out.logits[0, s].argmax()))
            teacher_words[word] += 1
            pooled.append((out.hidden_states[pair[0]][0][torch.as_tensor(a.student_span == k)].double().mean(0),
                           h_t[torch.as_tensor(a.teacher_span == k)].mean(0)))
    y, x = (torch.stack([p[j] for p in pooled]) for j in (0, 1))
    y, x = y - y.mean(0), x - x.mean(0)  # CKA = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) of the centred rows
    return agree, spans, float((y.T @ x).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm())), teacher_words


def test_kdcache_eval_scores_the_run_and_its_baseline_by_spans(setup: dict[str, Path],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache.stages.train.evaluation.eval_records import find_eval
    from kdcache.stages.train.evaluation.span_eval import evaluate_spans
    from kdcache.storage import CacheReader

    run, reader = setup["root"] / "gold", CacheReader(setup["cache"])
    assert main(["eval", "--cache", str(setup["cache"]), "--run", str(run), "--batch-size", "5"]) == 0
    out = capsys.readouterr().out
    trained = find_eval(run, "trained")
    assert trained is not None and trained["kind"] == "cross_tokenizer" and trained["cross_tokenizer"] == "gold"
    direct = evaluate_spans(run, reader, batch_size=4)
    agree, spans, cka, _ = _reference(setup, run / "student", (1, 2))
    assert trained["span_top1"] == pytest.approx(direct["span_top1"]) and direct["span_top1"] == pytest.approx(
        agree / spans)
    assert trained["spans"] == spans and trained["pairs"] == [[1, 2]] and trained["pairs_from"] == "run"
    assert trained["span_cka"]["s1_t2"] == pytest.approx(cka, abs=1e-4) == trained["span_cka_mean"]
    assert trained["span_cosine_mean"] == pytest.approx(direct["span_cosine"]["s1_t2"])
    tokens = sum(len(reader[i]["input_ids"]) for i in range(len(reader)))  # every row's teacher tokens
    assert trained["cache"]["sequences"] == len(reader) and trained["cache"]["tokens"] == tokens
    assert trained["tokens_unit"] == "teacher tokens" and trained["role"] == "trained"
    assert f"span top-1       {trained['span_top1']:.4f}" in out and "teacher tokens" in out
    assert main(["eval", "--cache", str(setup["cache"]), "--run", str(run), "--student", str(setup["student"]),
                 "--json"]) == 0
    baseline = find_eval(run, "baseline")
    agree, _, cka, _ = _reference(setup, setup["student"], (1, 2))
    assert baseline is not None and baseline["role"] == "baseline"
    assert baseline["span_top1"] == pytest.approx(agree / spans)
    assert baseline["span_cka"]["s1_t2"] == pytest.approx(cka, abs=1e-4)


def test_the_run_report_shows_the_span_columns(setup: dict[str, Path]) -> None:
    from kdcache.pipeline.report import fmt
    from kdcache.stages.train.evaluation.eval_records import read_evals

    run = setup["root"] / "gold"
    evals = read_evals(run)  # the previous test's baseline and trained records
    assert [e["role"] for e in evals] == ["baseline", "trained"]
    assert main(["report", str(run), "--out", str(setup["root"] / "gold-report")]) == 0
    page = (setup["root"] / "gold-report" / "report.html").read_text()
    for header in ("span top-1 ↑", "span CKA ↑", "span cosine ↑", "aligned share ↑"):
        assert header in page, header
    for record in evals:
        for key in ("span_top1", "span_cka_mean", "aligned_share"):
            assert f"<td>{fmt(record[key])}</td>" in page, (record["role"], key)


def test_a_run_without_a_layer_map_gets_span_cka_on_the_uniform_map(setup: dict[str, Path]) -> None:
    """A CE-only run (--gamma 0) records no layer map; nor does a run not trained yet, whose baseline is scored
    with --cross-tokenizer (no options.json yet): span CKA falls back to the uniform map, named in the record."""
    from kdcache.stages.train.evaluation.eval_records import find_eval
    from kdcache.stages.train.evaluation.evaluate import EvaluationError
    from kdcache.stages.train.evaluation.span_eval import evaluate_spans
    from kdcache.storage import CacheReader, read_json_object

    run = setup["root"] / "ce"
    assert main(_argv(setup, "cache", "ce", "--cross-tokenizer", "--beta", "0", "--gamma", "0")) == 0
    assert read_json_object(run / "plan.json")["hidden_pairs"] == []
    assert main(["eval", "--cache", str(setup["cache"]), "--run", str(run), "--json"]) == 0
    record = find_eval(run, "trained")
    assert record is not None and record["pairs"] == [[2, 2]] and record["pairs_from"] == "uniform"
    _, _, cka, _ = _reference(setup, run / "student", (2, 2))
    assert record["span_cka"] == {"s2_t2": pytest.approx(cka, abs=1e-4)} and record["span_cosine"] == {}
    assert any("uniform map" in n for n in record["notes"])
    # the caller may fix the pairs (to compare runs whose maps differ on the same ones)
    given = evaluate_spans(run, CacheReader(setup["cache"]), pairs=[(1, 2)])
    _, _, cka, _ = _reference(setup, run / "student", (1, 2))
    assert given["pairs_from"] == "given" and given["span_cka"] == {"s1_t2": pytest.approx(cka, abs=1e-4)}
    with pytest.raises(EvaluationError, match=r"teacher layers the cache holds \(\[0, 2\]\)"):
        evaluate_spans(run, CacheReader(setup["cache"]), pairs=[(1, 1)])
    before = setup["root"] / "not-trained"
    assert main(["eval", "--cache", str(setup["cache"]), "--run", str(before), "--student", str(setup["student"]),
                 "--cross-tokenizer", "--json"]) == 0
    baseline = find_eval(before, "baseline")
    _, _, cka, _ = _reference(setup, setup["student"], (2, 2))
    assert baseline is not None and baseline["span_cka"] == {"s2_t2": pytest.approx(cka, abs=1e-4)}


def test_eval_on_a_cache_without_texts_exits_2(setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache.pipeline.cli.commands.sweep import _eval_cache_problems

    assert main(["eval", "--cache", str(setup["old"]), "--run", str(setup["root"] / "gold")]) == 2
    err = capsys.readouterr().err
    assert "no recorded text" in err and "--record-text" in err and "Traceback" not in err
    # a sweep of --cross-tokenizer runs refuses the same eval cache before its first run
    assert any("--record-text" in p for p in _eval_cache_problems(str(setup["old"]), str(setup["student"]), True))
    assert _eval_cache_problems(str(setup["cache"]), str(setup["student"]), True) == []


def test_next_text_agreement_rule() -> None:
    """Same word across tokenizers agrees; a prefix or a lone space does not; whitespace agrees with whitespace."""
    from kdcache.stages.train.evaluation.span_eval import next_text

    def same_next_text(a: str, b: str) -> bool:  # the rule _update applies to two decoded top-1 tokens
        return next_text(a) == next_text(b)

    assert same_next_text(" Quick", "quick") and same_next_text("##ing", "ing") and same_next_text(" ", "\n")
    assert not same_next_text("qu", "quick") and not same_next_text(" ", "a") and not same_next_text("q", "quick")
    assert same_next_text("##", " ")
    assert not same_next_text("fox", "dog")


def test_the_teacher_agrees_with_its_own_cache_through_the_cross_path(setup: dict[str, Path]) -> None:
    """The ceiling: the teacher as the student, its own tokenizer with its own BOS, scored against its cache: every
    span one token and every top-1 the cached one, whitespace predictions included. The best constant scores less."""
    from kdcache.stages.train.evaluation.span_eval import evaluate_spans
    from kdcache.storage import CacheReader

    scored = evaluate_spans(setup["root"] / "gold", CacheReader(setup["cache"]), student=setup["root"] / "teacher",
                            batch_size=4)
    assert scored["aligned_share"] == 1.0 and scored["span_top1"] == 1.0 and scored["spans"] > 0
    assert 0 < scored["span_top1_floor"] < 1.0


@pytest.mark.parametrize("cache", ["cache", "old"])
def test_without_the_option_another_tokenizer_is_refused(setup: dict[str, Path], cache: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal names the mismatch and the way out: --cross-tokenizer, and --record-text for a cache without
    texts."""
    assert main(_argv(setup, cache, f"plain-{cache}")) == 2
    err = capsys.readouterr().err
    assert "tokenizer" in err and "train and evaluate it with --cross-tokenizer" in err and "Traceback" not in err
    assert ("re-run stage one with --record-text" in err) == (cache == "old")


def test_gold_other_refuses_a_temperature_it_cannot_apply(setup: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(setup, "cache", "other-t2", "--cross-tokenizer", "gold", "--topk-kl", "other")) == 2
    err = capsys.readouterr().err
    assert "--topk-kl other" in err and "temperature is 2" in err and "Traceback" not in err


def test_uld_takes_the_variant_and_temperature_it_does_not_read(setup: dict[str, Path]) -> None:
    """ULD compares sorted probabilities at T = 1: --topk-kl other at T = 2 is no reason to refuse it."""
    argv = _argv(setup, "cache", "uld-other-t2", "--cross-tokenizer", "uld", "--topk-kl", "other",
                 "--temperature", "2", "--no-export")
    argv[argv.index("--max-steps") + 1] = "1"
    assert main(argv) == 0
    assert len(read_jsonl(setup["root"] / "uld-other-t2" / "metrics.jsonl")) == 1


@pytest.mark.parametrize("beta", [[], ["--beta", "0"]])
def test_a_student_smaller_than_its_tokenizer_is_refused(setup: dict[str, Path], beta: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """With or without the KL: its tokenizer's ids would index past the student's embedding either way."""
    from transformers import AutoTokenizer, LlamaConfig

    small = setup["root"] / "small-student"
    tok = AutoTokenizer.from_pretrained(str(setup["student"]))
    tok.save_pretrained(str(small))
    LlamaConfig(vocab_size=len(tok) - 10, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=32, max_position_embeddings=128).save_pretrained(str(small))
    argv = _argv(setup, "cache", "small-run", "--cross-tokenizer", *beta)
    argv[argv.index("--student") + 1] = str(small)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"has {len(tok)} tokens" in err and f"is {len(tok) - 10}" in err and "Traceback" not in err


def test_a_cache_without_texts_says_what_it_lacks(setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(setup, "old", "old-run", "--cross-tokenizer", "uld")) == 2
    err = capsys.readouterr().err
    assert "no recorded text" in err and "--record-text" in err and "Traceback" not in err


def test_same_tokenizer_cross_model_equals_the_ordinary_losses(setup: dict[str, Path]) -> None:
    """The cross path with the teacher's own tokenizer: every span one token, so each term is the ordinary one."""
    from kdcache.stages.train.core.checks import open_cache
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.feed.streaming import collate, to_device
    from kdcache.stages.train.loop import prepare
    from kdcache.stages.train.loss import DistillationLoss, DistillModel

    reader = open_cache(str(setup["cache"]))
    # a student built on the teacher's own tokenizer
    teacher_like = setup["root"] / "same"
    if not teacher_like.exists():
        from tests.stages.train._train_support import make_student_config

        make_student_config(teacher_like, setup["root"] / "teacher", hidden_size=16, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=32)
        for f in (setup["root"] / "teacher").glob("tok*"):
            (teacher_like / f.name).write_bytes(f.read_bytes())
        for f in (setup["root"] / "teacher").glob("special*"):
            (teacher_like / f.name).write_bytes(f.read_bytes())
    options = TrainOptions.of(cache=str(setup["cache"]), student=str(teacher_like), out=str(setup["root"] / "x"),
                              layer_map=["explicit:1-2"], cross_tokenizer="gold", temperature=2.0)
    reader, student, facts, plan, options = prepare(options)
    torch.manual_seed(0)
    cross = build_cross_model(options, reader, student,
                              DistillationLoss.planned(without_logit_kl(options), plan, facts, reader, student),
                              announce=False)
    assert isinstance(cross, CrossDistillModel) and isinstance(cross.aligner, SpanAligner)
    ordinary = DistillModel(student, DistillationLoss.planned(options, plan, facts, reader, student, announce=False))
    ordinary.criterion.load_state_dict(cross.criterion.state_dict())  # the same projector weights
    seqs = [reader.get(i, list(plan.names)) for i in range(4)]
    host = collate(seqs, list(range(4)))
    cross.aligner.extend(host)  # what the stream does with each batch
    batch = to_device(host, "cpu")
    cross.eval(), ordinary.eval()
    with torch.no_grad():
        a, b = cross(batch), ordinary(batch)
    assert a["aligned_share"].item() == 1.0
    for key_a, key_b in (("ce", "ce"), ("gold", "topk_kl"), ("hidden/s1_t2", "hidden/s1_t2")):
        assert a[key_a].item() == pytest.approx(b[key_b].item(), abs=1e-5), key_a


@pytest.mark.parametrize("loss", ["gold", "uld"])
def test_the_chunked_head_gives_the_materialised_logits_values_and_gradients(setup: dict[str, Path],
                                                                             loss: str) -> None:
    """The cross path builds the student's span logits chunk by chunk from its head; the same step with the
    student's own materialised logits is the reference (train mode), for every term and every gradient."""
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.feed.streaming import collate, to_device
    from kdcache.stages.train.loop import prepare
    from kdcache.stages.train.loss import DistillationLoss

    options = TrainOptions.of(cache=str(setup["cache"]), student=str(setup["student"]), out=str(setup["root"] / "y"),
                              layer_map=["explicit:1-2"], cross_tokenizer=loss, topk_kl="other", temperature=1.0)
    reader, student, facts, plan, options = prepare(options)
    cross = build_cross_model(options, reader, student,
                              DistillationLoss.planned(without_logit_kl(options), plan, facts, reader, student),
                              announce=False)
    host = collate([reader.get(i, list(plan.names)) for i in range(6)], list(range(6)))
    cross.aligner.extend(host)
    batch = to_device(host, "cpu")
    cross.train()
    results = []
    for head in ("chunked", "materialised"):
        cross.criterion._head = None if head == "chunked" else (None,)
        cross.zero_grad()
        out = cross(batch)
        assert (cross.criterion._head[0] is not None) == (head == "chunked")  # the Llama student's head is a plain linear
        out["loss"].backward()
        grads = {n: p.grad.clone() for n, p in cross.named_parameters() if p.grad is not None}
        results.append(({k: v.item() for k, v in out.items()}, grads))
    (chunked, g_chunked), (full, g_full) = results
    assert chunked.keys() == full.keys() and loss in chunked
    for key in chunked:
        assert chunked[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key
    assert g_chunked.keys() == g_full.keys() and "student.lm_head.weight" in g_chunked
    for name in g_chunked:
        assert torch.allclose(g_chunked[name], g_full[name], rtol=1e-4, atol=1e-6), name


def test_the_vocabulary_path_is_said_once_when_only_the_span_term_reads_the_head(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The student runs through the run's loss (its head choice and its notes); with --alpha 0 that loss holds no
    vocabulary term of its own, yet the gold term applies the head, so the run still says which path it takes, once."""
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.feed.streaming import collate, to_device
    from kdcache.stages.train.loop import prepare
    from kdcache.stages.train.loss import DistillationLoss

    options = TrainOptions.of(cache=str(setup["cache"]), student=str(setup["student"]), out=str(setup["root"] / "z"),
                              layer_map=["explicit:1-2"], cross_tokenizer="gold", alpha=0.0)
    reader, student, facts, plan, options = prepare(options)
    criterion = DistillationLoss.planned(without_logit_kl(options), plan, facts, reader, student, announce=True)
    cross = build_cross_model(options, reader, student, criterion, announce=True)
    host = collate([reader.get(i, list(plan.names)) for i in range(2)], [0, 1])
    cross.aligner.extend(host)
    capsys.readouterr()
    with torch.no_grad():
        first, _ = cross(to_device(host, "cpu")), cross(to_device(host, "cpu"))
    assert "ce" not in first and "gold" in first
    assert capsys.readouterr().err.count("kdcache train: vocabulary losses: chunked") == 1


def test_pieces_of_characters_agree_only_with_the_same_piece() -> None:
    """Every byte-level piece of a character decodes to U+FFFD: two different pieces must not agree by it, and the
    same piece must (the teacher with itself)."""
    from types import SimpleNamespace

    from kdcache.stages.train.evaluation.span_eval import token_text

    pieces = {1: "Ã", 2: "Â", 3: "Ġquick"}
    tok = SimpleNamespace(decode=lambda ids: "\ufffd" if ids[0] in (1, 2) else " quick",
                          convert_ids_to_tokens=lambda i: pieces[i])
    assert token_text(tok, 1) == token_text(tok, 1) != token_text(tok, 2)
    assert token_text(tok, 3) == "quick"
