"""Cross-tokenizer distillation (issue 35): spans by GOLD's rule, and the losses across vocabularies.

Two real tokenizers trained here (a byte-level BPE and a lower-casing WordPiece); every loss is checked against
a reference written below from its formula, span by span in plain Python.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.stages.common.cache_texts import char_mask, row_text, token_pieces
from kdcache.stages.precompute.rows.packing import span_mask as token_span_mask
from kdcache.stages.targets.hidden.loss_terms import masked_mse
from kdcache.stages.targets.logits.topk_torch import topk_kl, topk_kl_renorm
from kdcache.stages.train.cross.align import align, aligned_share, student_ends, student_mask
from kdcache.stages.train.losses import get_loss
from kdcache.stages.train.losses.cross_vocab import shared_vocab, span_mean, span_rows
from tests.helpers.tiny_models import train_bpe_tokenizer, train_wordpiece_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Knowledge distillation trains a student!"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    root = tmp_path_factory.mktemp("tokenizers")
    return train_bpe_tokenizer(root / "bpe", vocab_size=300), train_wordpiece_tokenizer(root / "wp", vocab_size=120)


def _ends(tokenizer: Any, text: str) -> np.ndarray:
    return student_ends(tokenizer, text)[1]


def test_hand_example() -> None:
    # text "abc de fgh": teacher | BOS | abc | ␣de | ␣fgh |, student | ab | c | ␣d | e␣fgh |
    a = align(np.array([0, 3, 6, 10]), np.array([2, 3, 5, 10]))
    assert a.teacher_span.tolist() == [0, 0, 1, 1] and a.student_span.tolist() == [0, 1, 1, 1][:0] + [0, 0, 1, 1]
    assert a.spans == 2 and a.last("teacher").tolist() == [1, 3] and a.last("student").tolist() == [1, 3]
    assert a.one_to_one() == 0 and aligned_share([a]) == 0.0
    split = align(np.array([1, 4, 4, 7]), np.array([1, 4, 7]))  # a character in two byte tokens on one side
    assert split.teacher_span.tolist() == [0, 1, 1, 2] and split.student_span.tolist() == [0, 1, 2]
    assert split.last("teacher").tolist() == [0, 2, 3]  # span 1 ends on the byte that completes the character
    same = align(np.array([1, 4, 4, 7]), np.array([1, 4, 4, 7]))  # one tokenizer: each span one token
    assert same.teacher_span.tolist() == [0, 1, 2, 3] and aligned_share([same]) == 1.0


def test_spans_of_two_real_tokenizers_equal_the_common_boundaries(tokenizers: tuple[Any, Any]) -> None:
    bpe, wp = tokenizers
    te, se = _ends(bpe, TEXT), _ends(wp, TEXT)
    a = align(te, se)
    # reference: the common end boundaries; a token belongs to the first boundary at or after its end
    bounds = sorted(set(te.tolist()) & set(se.tolist()))
    assert a.spans == len(bounds) and bounds[-1] == len(TEXT)
    assert a.teacher_span.tolist() == np.searchsorted(bounds, te).tolist()
    assert a.student_span.tolist() == np.searchsorted(bounds, se).tolist()
    # every span covers the same characters on both sides, and the two tokenizers do differ
    assert a.spans <= min(len(te), len(se)) and len(te) != len(se) and 0 < aligned_share([a]) < 1
    for k in range(a.spans):
        tk, sk = np.flatnonzero(a.teacher_span == k), np.flatnonzero(a.student_span == k)
        assert te[tk[-1]] == se[sk[-1]]
        assert (te[tk[0] - 1] if tk[0] else 0) == (se[sk[0] - 1] if sk[0] else 0)


def test_chat_mask_moves_to_the_students_tokens(tokenizers: tuple[Any, Any]) -> None:
    bpe, wp = tokenizers
    text = "user: Open a file. assistant: Return the number of items. user: thanks"
    start = text.index("Return")
    spans = [(start, text.index(" user:"))]
    enc = bpe(text, add_special_tokens=False, return_offsets_mapping=True)
    t_mask = token_span_mask(enc["offset_mapping"], spans)
    _, te = row_text(token_pieces(text, enc["offset_mapping"]))
    se = _ends(wp, text)
    a = align(te, se)
    s_mask = student_mask(a, t_mask)
    # in characters: the student trains on the teacher's trained characters, plus at most the whitespace a span
    # takes with it (a piece holds the whitespace before its token)
    s_chars, t_chars = char_mask(se, s_mask), char_mask(te, t_mask)
    assert (s_chars >= t_chars).all() and t_chars.sum() > 0
    assert all(text[i].isspace() for i in np.flatnonzero(s_chars != t_chars))
    trained = "".join(c for c, m in zip(text, char_mask(se, s_mask)) if m)
    assert trained.strip() == "Return the number of items."


def test_packed_row_with_eos_between_documents(tokenizers: tuple[Any, Any]) -> None:
    bpe, wp = tokenizers
    docs = ["Split the string at the first occurrence.", " The student never loads the teacher."]
    pieces: list[str] = []
    for doc in docs:  # what stage one's packing records: each document's pieces, then an EOS covering nothing
        enc = bpe(doc, add_special_tokens=False, return_offsets_mapping=True)
        pieces += token_pieces(doc, enc["offset_mapping"]) + [""]
    text, te = row_text(pieces)
    assert text == "".join(docs)
    a = align(te, _ends(wp, text))
    eos = np.flatnonzero(np.diff(np.concatenate([[0], te])) == 0)
    assert (a.teacher_span >= 0).all() and (a.student_span >= 0).all()
    # the EOS between documents closes its document's last span (the student, with no EOS, predicts the next
    # document's first text there, as the EOS does); the last one joins the last span
    assert a.teacher_span[eos[0]] == a.teacher_span[eos[0] - 1] != a.teacher_span[eos[0] + 1]
    assert a.teacher_span[-1] == a.spans - 1


def test_student_cut_short_leaves_the_rest_unaligned(tokenizers: tuple[Any, Any]) -> None:
    bpe, wp = tokenizers
    te = _ends(bpe, TEXT)
    ids, se = student_ends(wp, TEXT, max_length=5)
    a = align(te, se)
    assert len(ids) == 5 and (a.teacher_span[te > se[-1]] == -1).all()
    assert a.student_span.max() == a.spans - 1


# ---- losses ------------------------------------------------------------------------------------------------
def _identity_setup(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, length, v, k = 2, 6, 11, 4
    z_t = torch.randn(b, length, v, generator=g) * 2
    values, ids = torch.topk(z_t, k, dim=-1)
    return {"z_s": torch.randn(b, length, v, generator=g, requires_grad=True), "values": values, "ids": ids,
            "lse": torch.logsumexp(z_t, -1), "mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1]]),
            "h_s": torch.randn(b, length, 5, generator=g), "h_t": torch.randn(b, length, 5, generator=g)}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_same_tokenizer_equals_the_ordinary_path(temperature: float) -> None:
    x = _identity_setup()
    b, length = x["mask"].shape
    span = torch.arange(length).expand(b, -1)  # one tokenizer: every span is one token
    shared = torch.arange(x["z_s"].shape[-1])
    gold = get_loss("gold")(span_rows(x["z_s"], span), span_rows(x["values"], span), span_rows(x["ids"], span),
                            span_rows(x["lse"], span), x["mask"], shared, temperature=temperature)
    ordinary = topk_kl_renorm(x["z_s"], x["values"], x["ids"], x["mask"], temperature=temperature)
    assert gold.item() == pytest.approx(ordinary.item(), abs=1e-5)
    pooled = masked_mse(span_mean(x["h_s"], span, length), span_mean(x["h_t"], span, length), x["mask"])
    assert pooled.item() == pytest.approx(masked_mse(x["h_s"], x["h_t"], x["mask"]).item(), abs=1e-6)


def test_same_tokenizer_gold_other_equals_the_ordinary_other_kl() -> None:
    """--topk-kl other: GOLD's exact part is the ordinary k + 1 bucket KL when every id is shared (T = 1)."""
    x = _identity_setup(4)
    b, length = x["mask"].shape
    span = torch.arange(length).expand(b, -1)
    shared = torch.arange(x["z_s"].shape[-1])
    gold = get_loss("gold")(span_rows(x["z_s"], span), span_rows(x["values"], span), span_rows(x["ids"], span),
                            span_rows(x["lse"], span), x["mask"], shared, variant="other")
    ordinary = topk_kl(x["z_s"], x["values"], x["ids"], x["mask"], x["lse"], variant="other")
    assert gold.item() == pytest.approx(ordinary.item(), abs=1e-5)


def _reference_gold_other(z_s: list[float], values: list[float], ids: list[int], lse: float,
                          shared: list[int]) -> float:
    """GOLD with the k + 1 bucket exact part, from the formula (docs/losses.md), at T = 1."""
    q = [math.exp(v) for v in values]
    q = [x / sum(q) for x in q]
    s_idx = [i for i, tid in enumerate(ids) if shared[tid] >= 0]
    w = sum(q[i] for i in s_idx)
    total = sum(math.exp(z) for z in z_s)
    p_t = [math.exp(values[i] - lse) for i in s_idx]
    p_s = [math.exp(z_s[shared[ids[i]]]) / total for i in s_idx]
    p_t.append(1 - sum(p_t))
    p_s.append(1 - sum(p_s))
    exact = sum(a * math.log(a / c) for a, c in zip(p_t, p_s) if a > 0)
    hidden = {s for s in shared if s >= 0}
    probs = [math.exp(z) / total if j not in hidden else 0.0 for j, z in enumerate(z_s)]
    a = [math.exp(values[i] - lse) for i in range(len(ids)) if i not in s_idx]
    a += [0.0] * (len(ids) - len(a))
    return w * exact + (1 - w) * _reference_uld(a, probs)


def test_gold_other_equals_its_formula_with_some_ids_shared() -> None:
    x = _identity_setup(5)
    vocab = x["z_s"].shape[-1]
    shared = torch.tensor([(j * 7) % vocab if j % 3 else -1 for j in range(vocab)])  # a permuted two thirds
    got = get_loss("gold")(x["z_s"], x["values"], x["ids"], x["lse"], x["mask"], shared, variant="other")
    refs = [_reference_gold_other(x["z_s"][b, i].tolist(), x["values"][b, i].tolist(), x["ids"][b, i].tolist(),
                                  x["lse"][b, i].item(), shared.tolist())
            for b in range(2) for i in range(6) if x["mask"][b, i]]
    assert got.item() == pytest.approx(sum(refs) / len(refs), rel=1e-5)
    got.backward()
    assert torch.isfinite(x["z_s"].grad).all()


def _reference_uld(p_t: list[float], p_s: list[float]) -> float:
    a, b = sorted(p_t, reverse=True), sorted(p_s, reverse=True)[:len(p_t)]
    b += [0.0] * (len(a) - len(b))
    return sum(abs(x - y) for x, y in zip(a, b))


def _reference_gold(z_s: list[float], values: list[float], ids: list[int], lse: float, shared: list[int],
                    t: float) -> float:
    q = [math.exp(v / t) for v in values]
    q = [x / sum(q) for x in q]
    s_idx = [i for i, tid in enumerate(ids) if shared[tid] >= 0]
    w = sum(q[i] for i in s_idx)
    exact = 0.0
    if s_idx:
        qs = [math.exp(values[i] / t) for i in s_idx]
        rs = [math.exp(z_s[shared[ids[i]]] / t) for i in s_idx]
        qs, rs = [x / sum(qs) for x in qs], [x / sum(rs) for x in rs]
        exact = t * t * sum(a * math.log(a / b) for a, b in zip(qs, rs) if a > 0)
    total = sum(math.exp(z) for z in z_s)
    hidden = {s for s in shared if s >= 0}  # the whole shared student vocabulary
    p_s = [math.exp(z) / total if j not in hidden else 0.0 for j, z in enumerate(z_s)]
    a = [math.exp(values[i] - lse) for i in range(len(ids)) if i not in s_idx]
    a += [0.0] * (len(ids) - len(a))
    return w * exact + (1 - w) * _reference_uld(a, p_s)


def test_worked_example_losses_equal_their_formulas(tokenizers: tuple[Any, Any]) -> None:
    bpe, wp = tokenizers
    te, se = _ends(bpe, TEXT), _ends(wp, TEXT)
    a = align(te, se)
    g = torch.Generator().manual_seed(3)
    vt, vs, k, d = len(bpe), len(wp), 5, 4
    z_t = torch.randn(1, len(te), vt, generator=g) * 3
    values, ids = torch.topk(z_t, k, dim=-1)
    lse = torch.logsumexp(z_t, -1)
    z_s = torch.randn(1, len(se), vs, generator=g) * 3
    shared = shared_vocab(bpe.get_vocab(), wp.get_vocab(), vt)
    assert 0 < int((shared >= 0).sum()) < vt
    t_last, s_last = torch.as_tensor(a.last("teacher"))[None], torch.as_tensor(a.last("student"))[None]
    mask = torch.ones(1, a.spans)
    mask[0, 1] = 0
    rows = {"s": span_rows(z_s, s_last), "v": span_rows(values, t_last), "i": span_rows(ids, t_last),
            "l": span_rows(lse, t_last)}
    # force some of the teacher's ids to be shared so both parts of GOLD are exercised
    shared_ids = sorted(set(rows["i"][0, :, :2].flatten().tolist()))
    shared[shared_ids] = torch.arange(len(shared_ids)) % vs
    uld = get_loss("uld")(rows["s"], rows["v"], rows["l"], mask).item()
    gold = get_loss("gold")(rows["s"], rows["v"], rows["i"], rows["l"], mask, shared, temperature=1.5).item()
    ref_uld, ref_gold = [], []
    for kk in range(a.spans):
        if not mask[0, kk]:
            continue
        ti, si = int(a.last("teacher")[kk]), int(a.last("student")[kk])
        zs = z_s[0, si].tolist()
        p_s = [math.exp(z) / sum(math.exp(y) for y in zs) for z in zs]
        p_t = [math.exp(v - lse[0, ti].item()) for v in values[0, ti].tolist()]
        ref_uld.append(_reference_uld(p_t, p_s))
        ref_gold.append(_reference_gold(zs, values[0, ti].tolist(), ids[0, ti].tolist(), lse[0, ti].item(),
                                        shared.tolist(), 1.5))
    assert uld == pytest.approx(sum(ref_uld) / len(ref_uld), rel=1e-5)
    assert gold == pytest.approx(sum(ref_gold) / len(ref_gold), rel=1e-5)
    # hidden states: mean over each span's tokens, then the ordinary loss
    h_s, h_t = torch.randn(1, len(se), d, generator=g), torch.randn(1, len(te), d, generator=g)
    pooled = span_mean(h_s, torch.as_tensor(a.student_span)[None], a.spans)
    for kk in range(a.spans):
        ref = h_s[0, torch.as_tensor(a.student_span == kk)].mean(0)
        assert torch.allclose(pooled[0, kk], ref, atol=1e-6)
    pooled_t = span_mean(h_t, torch.as_tensor(a.teacher_span)[None], a.spans)
    ref_mse = sum(((pooled[0, kk] - pooled_t[0, kk]) ** 2).sum().item() for kk in range(a.spans) if mask[0, kk])
    assert masked_mse(pooled, pooled_t, mask).item() == pytest.approx(ref_mse / (mask.sum().item() * d), rel=1e-5)


def test_gold_gradient_is_finite_when_nothing_is_shared() -> None:
    x = _identity_setup(1)
    none = torch.full((x["z_s"].shape[-1],), -1)
    loss = get_loss("gold")(x["z_s"], x["values"], x["ids"], x["lse"], x["mask"], none)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x["z_s"].grad).all()
    uld = get_loss("uld")(x["z_s"], x["values"], x["lse"], x["mask"])
    assert loss.item() == pytest.approx(uld.item(), rel=1e-6)  # nothing shared: GOLD is ULD


@pytest.mark.parametrize("loss", ["gold", "uld"])
def test_spans_not_counted_get_no_gradient_and_do_not_move_the_loss(loss: str) -> None:
    """The span losses weigh every row instead of selecting (no host sync): what they leave out must stay out."""
    x = _identity_setup(2)
    shared = torch.arange(x["z_s"].shape[-1]) % 3 - 1  # some ids shared, some not

    def value(z_s: torch.Tensor) -> torch.Tensor:
        if loss == "uld":
            return get_loss("uld")(z_s, x["values"], x["lse"], x["mask"])
        return get_loss("gold")(z_s, x["values"], x["ids"], x["lse"], x["mask"], shared, temperature=2.0)

    out = value(x["z_s"])
    out.backward()
    left_out = x["mask"] == 0
    assert (x["z_s"].grad[left_out] == 0).all() and (x["z_s"].grad[~left_out] != 0).any()
    moved = x["z_s"].detach().clone()
    moved[left_out] = torch.randn(int(left_out.sum()), moved.shape[-1]) * 50
    assert value(moved).item() == pytest.approx(out.item(), rel=1e-6)


def test_shared_vocab_maps_equal_strings(tokenizers: tuple[Any, Any], tmp_path: Path) -> None:
    bpe, wp = tokenizers
    shared = shared_vocab(bpe.get_vocab(), wp.get_vocab(), len(bpe))
    s_vocab = wp.get_vocab()
    for token, t_id in bpe.get_vocab().items():
        assert shared[t_id].item() == s_vocab.get(token, -1)
