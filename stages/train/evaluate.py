"""Student-vs-teacher agreement measured against a cache: no teacher in memory.

Everything the teacher contributes comes from a (usually held-out) cache; the student comes from a run's
``student/`` folder, its layer map from ``plan.json`` and its projectors from ``projectors.pt``. This module
never imports stage one and never loads a teacher.

* Encoders are compared the way sentence-embedding users compare them: mean-pooled final states, their cosine
  (same width, or through the run's projector for the last pair), and the Spearman correlation of the two
  models' pairwise-similarity matrices (any width: it only compares how each model ranks pairs of sentences).
* Causal LMs (the cache has logits): the student's perplexity on the cached ``input_ids``, top-1 agreement
  with the teacher, and KL(teacher ‖ student) per valid token at T=1.
* Every run: linear CKA for every (student layer, cached teacher layer) pair — the alignment heatmap — and
  its values on the run's layer map.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kdcache.stages.train.losses import kd_kl, topk_kl
from kdcache.storage import CacheReader, to_float32
from kdcache.storage.errors import KdcacheError


class EvaluationError(KdcacheError):
    """The run or the cache cannot be evaluated (no exported student, nothing comparable in the cache)."""


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average the valid tokens of each sequence.

    Args:
        hidden: [B, L, d] states.
        mask: [B, L], 1 for real tokens.

    Returns:
        [B, d] sentence embeddings.
    """
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation of two 1-D arrays (average ranks are not needed: ties are rare in floats)."""
    ranks_a = np.argsort(np.argsort(a)).astype(np.float64)
    ranks_b = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])


def similarity_agreement(student_emb: torch.Tensor, teacher_emb: torch.Tensor) -> dict[str, float]:
    """Compare two sets of sentence embeddings of the same sentences.

    Args:
        student_emb: [n, d_s].
        teacher_emb: [n, d_t].

    Returns:
        ``spearman``: of the off-diagonal pairwise cosine similarities; ``cosine``: mean per-sentence cosine,
        only when d_s == d_t.
    """
    def pairwise(emb: torch.Tensor) -> np.ndarray:
        unit = torch.nn.functional.normalize(emb.double(), dim=-1)
        sims = (unit @ unit.T).numpy()
        return sims[np.triu_indices(len(sims), k=1)]

    out = {"spearman": spearman(pairwise(student_emb), pairwise(teacher_emb))}
    if student_emb.shape[-1] == teacher_emb.shape[-1]:
        out["cosine"] = float(torch.nn.functional.cosine_similarity(student_emb.double(), teacher_emb.double()).mean())
    return out


@torch.no_grad()
def encoder_agreement(model: Any, reader: CacheReader, layer: int, *, batch_size: int = 32,
                      device: str | torch.device = "cpu") -> dict[str, float]:
    """Agreement of an HF encoder's final states with the cached teacher layer ``layer``.

    Args:
        model: an HF model returning ``last_hidden_state`` (or ``hidden_states``).
        reader: a cache holding ``hidden/{layer}`` for the held-out sentences.
        layer: the teacher layer to compare with (usually the last).
        batch_size: sequences per forward pass.
        device: where the student runs.
    """
    model.eval()
    students, teachers = [], []
    name = f"hidden/{layer}"
    for ids, mask, targets in cache_batches(reader, ["input_ids", name], batch_size):
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        students.append(mean_pool(out.hidden_states[-1].float().cpu(), mask))
        teachers.append(mean_pool(targets[name], mask))
    return similarity_agreement(torch.cat(students), torch.cat(teachers))


def cache_batches(reader: CacheReader, names: list[str], batch_size: int, *, limit: int | None = None,
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """Padded batches of cached sequences, in cache order, read a whole shard at a time.

    Yields:
        ``input_ids [B, L]`` (int64), ``mask [B, L]`` and every other name in ``names`` as float32
        ``[B, L, ...]`` (int64 for ``logits/topk_ids``).
    """
    pending: list[dict[str, np.ndarray]] = []
    seen = 0
    for seq in reader.iter_sequences(names=names):
        if limit is not None and seen >= limit:
            break
        pending.append(seq)
        seen += 1
        if len(pending) == batch_size:
            yield _collate(pending, names, reader.spec.dtype)
            pending = []
    if pending:
        yield _collate(pending, names, reader.spec.dtype)


def _collate(seqs: list[dict[str, np.ndarray]], names: list[str], dtype: str,
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    ids, mask = _pad([torch.from_numpy(s["input_ids"].astype(np.int64)) for s in seqs])
    targets = {}
    for name in names:
        if name == "input_ids":
            continue
        if name in ("logits/topk_ids",):
            rows = [torch.from_numpy(s[name].astype(np.int64)) for s in seqs]
        elif name == "logits/lse":  # stored as float32 whatever the cache dtype
            rows = [torch.from_numpy(s[name].astype(np.float32)) for s in seqs]
        else:
            rows = [torch.from_numpy(to_float32(s[name], dtype)) for s in seqs]
        targets[name], _ = _pad(rows)
    return ids, mask, targets


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [L, ...] tensors to [B, L_max, ...] and return them with the [B, L_max] mask."""
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).long()
    return padded, mask


class CkaMatrix:
    """Exact linear CKA between every student layer and every teacher layer, over all valid tokens.

    Streams: each batch adds to per-layer sums and per-pair cross products in float64, so CKA is computed over
    the whole evaluation set without keeping any states. Centring happens at the end
    (Σ(x−μx)(y−μy)ᵀ = Σxyᵀ − n·μx·μyᵀ). Memory is O(pairs · d_s · d_t): fine for students and teachers up to
    a few thousand wide; a 7B teacher with many cached layers wants fewer of them (or a smaller eval cache).
    """

    def __init__(self, student_layers: list[int], teacher_layers: list[int]):
        self.student_layers, self.teacher_layers = list(student_layers), list(teacher_layers)
        self.n = 0
        self.sums: dict[str, torch.Tensor] = {}
        self.grams: dict[str, torch.Tensor] = {}

    def update(self, student: dict[int, torch.Tensor], teacher: dict[int, torch.Tensor]) -> None:
        """Add one batch. Args: ``{layer: [N_v, d]}`` valid-token rows of each side (same N_v, same order)."""
        sides = {f"s{j}": v.double() for j, v in student.items()}
        sides.update({f"t{j}": v.double() for j, v in teacher.items()})
        self.n += next(iter(sides.values())).shape[0]
        for key, rows in sides.items():
            self._add(self.sums, key, rows.sum(0))
            self._add(self.grams, key, rows.T @ rows)
        for s in self.student_layers:
            for t in self.teacher_layers:
                self._add(self.grams, f"t{t}s{s}", sides[f"t{t}"].T @ sides[f"s{s}"])

    def matrix(self) -> np.ndarray:
        """``[len(student_layers), len(teacher_layers)]`` CKA values in [0, 1]."""
        norms = {key: float(torch.linalg.matrix_norm(self._centred(key, key, key))) for key in self.sums}
        out = np.zeros((len(self.student_layers), len(self.teacher_layers)))
        for i, s in enumerate(self.student_layers):
            for k, t in enumerate(self.teacher_layers):
                cross = float(torch.linalg.matrix_norm(self._centred(f"t{t}s{s}", f"t{t}", f"s{s}")))
                # A constant layer (zero variance) has no alignment to speak of: 0, not NaN.
                denominator = norms[f"t{t}"] * norms[f"s{s}"]
                out[i, k] = cross**2 / denominator if denominator > 0 else 0.0
        return out

    def _centred(self, gram: str, left: str, right: str) -> torch.Tensor:
        return self.grams[gram] - torch.outer(self.sums[left], self.sums[right]) / self.n

    @staticmethod
    def _add(store: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
        store[key] = value if key not in store else store[key] + value


class LmStats:
    """Running sums of the causal-LM metrics: NLL of the next token, top-1 agreement and KL to the teacher."""

    def __init__(self, logits_kind: str | None):
        self.kind = logits_kind  # "full" | "topk" | None (no teacher logits: perplexity only)
        self.nll = self.predicted = self.agree = self.kl = self.tokens = 0.0

    def update(self, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
               targets: dict[str, torch.Tensor]) -> None:
        """Add one batch. Args: student ``logits [B, L, V]``, ``ids``/``mask [B, L]``, cached targets."""
        logits = logits.float()
        pairs = (mask[:, :-1] * mask[:, 1:]).bool()  # position i predicts token i+1
        log_probs = F.log_softmax(logits[:, :-1][pairs], dim=-1)
        self.nll -= float(log_probs.gather(1, ids[:, 1:][pairs][:, None]).sum())
        self.predicted += int(pairs.sum())
        if self.kind is None:
            return
        valid = mask.bool()
        teacher_top1 = (targets["logits/full"].argmax(-1) if self.kind == "full"
                        else targets["logits/topk_ids"][..., 0])
        self.agree += int((logits.argmax(-1) == teacher_top1)[valid].sum())
        n_valid = int(valid.sum())
        self.kl += float(self._kl(logits, mask, targets)) * n_valid  # the losses return a mean over valid tokens
        self.tokens += n_valid

    def _kl(self, logits: torch.Tensor, mask: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.kind == "full":
            return kd_kl(logits, targets["logits/full"], mask, temperature=1.0)
        # The other-bucket form puts the teacher's tail mass in one bucket: a true KL over a coarsened
        # vocabulary, unlike the renormalised form, which ignores the tail altogether.
        return topk_kl(logits, targets["logits/topk_values"], targets["logits/topk_ids"], mask,
                       targets["logits/lse"], variant="other", temperature=1.0)

    def result(self) -> dict[str, Any]:
        """``perplexity``, and with teacher logits ``top1_agreement`` and ``kl`` (nats per valid token)."""
        out: dict[str, Any] = {"perplexity": float(np.exp(self.nll / max(1.0, self.predicted))),
                               "predicted_tokens": int(self.predicted)}
        if self.kind is not None:
            out.update(top1_agreement=self.agree / max(1.0, self.tokens), kl=self.kl / max(1.0, self.tokens),
                       kl_form="full" if self.kind == "full" else "top-k + other bucket", tokens=int(self.tokens))
        return out


# ---- one run against one cache -----------------------------------------------------------------------------
def load_run(run_dir: str | Path, student_path: str | Path | None = None
             ) -> tuple[Any, list[tuple[int, int]], dict[str, torch.Tensor]]:
    """The student (eval mode), the run's hidden layer map and its projector weights.

    Args:
        run_dir: the run; its ``student/`` is scored unless ``student_path`` names another student.
        student_path: any student (a model folder, or a config.json folder: random init, seed 0), e.g. the
            untrained initial student as the run's baseline. It has no trained projectors.

    Raises:
        EvaluationError: no student to score (the run has no ``student/`` and none was named).
    """
    from kdcache.stages.train.student import load_student

    run = Path(run_dir)
    if student_path is None and not (run / "student" / "config.json").is_file():
        raise EvaluationError(f"{run} has no exported student/ (still training, failed, or --no-export); "
                              "evaluate a finished run, or name a student with --student")
    student = load_student(student_path or run / "student", seed=0).eval()
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").is_file() else {}
    pairs = [(int(s), int(t)) for s, t in plan.get("hidden_pairs", [])]
    projectors: dict[str, torch.Tensor] = {}
    if student_path is None and (run / "projectors.pt").is_file():
        projectors = torch.load(run / "projectors.pt", map_location="cpu").get("projectors", {})
    return student, pairs, projectors


@torch.no_grad()
def evaluate_run(run_dir: str | Path, reader: CacheReader, *, batch_size: int = 16, limit: int | None = None,
                 teacher_layer: int | None = None, device: str | torch.device = "cpu",
                 student: str | Path | None = None) -> dict[str, Any]:
    """Evaluate a run's exported student against a cache, in one pass over the cache.

    Args:
        run_dir: the run directory (``student/``, ``plan.json``, ``projectors.pt``).
        reader: the (held-out) cache.
        batch_size: sequences per forward pass.
        limit: evaluate only the first ``limit`` sequences.
        teacher_layer: the teacher layer final states are compared with (default: the deepest cached one).
        device: where the student runs.
        student: score this student instead of the run's (see ``load_run``).

    Returns:
        A JSON-ready dict: ``kind`` ("causal_lm" | "encoder"), the metrics of that kind, ``cka`` (the
        alignment matrix and its values on the layer map), ``sequences`` and ``tokens`` evaluated, and
        ``notes`` explaining anything skipped.
    """
    from kdcache.stages.train.student import student_facts

    model, pairs, projectors = load_run(run_dir, student)
    model.to(device)
    facts = student_facts(model, pretrained=True)
    spec = reader.spec
    kind = "causal_lm" if facts.is_causal and facts.has_lm_head else "encoder"
    teacher_layers = sorted(spec.hidden_layers)
    final = teacher_layer if teacher_layer is not None else (teacher_layers[-1] if teacher_layers else None)
    state = _EvalState(kind, spec.logits, list(range(facts.num_layers + 1)), teacher_layers, final)
    logit_names = _logit_names(spec.logits) if kind == "causal_lm" else []
    names = ["input_ids", *[f"hidden/{j}" for j in teacher_layers], *logit_names]
    _check_inputs(reader, facts, final, kind, state.notes)
    sequences = tokens = 0
    for ids, mask, targets in cache_batches(reader, names, batch_size, limit=limit):
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        state.update(out, ids, mask, {k: v.to(device) for k, v in targets.items()})
        sequences, tokens = sequences + int(ids.shape[0]), tokens + int(mask.sum())
    return {**state.result(pairs, projectors, facts.num_layers), "sequences": sequences, "tokens": tokens}


def _logit_names(logits: str | None) -> list[str]:
    return {"full": ["logits/full"], "topk": ["logits/topk_values", "logits/topk_ids", "logits/lse"]}.get(
        logits or "", [])


def _check_inputs(reader: CacheReader, facts: Any, final: int | None, kind: str, notes: list[str]) -> None:
    """Refuse what cannot be compared; note what will be skipped."""
    if facts.vocab_size < int(reader.spec.vocab_size or 0):
        raise EvaluationError(f"the cache's vocabulary has {reader.spec.vocab_size} tokens, the student's "
                              f"embedding {facts.vocab_size}: this cache was not made for this student")
    if final is None:
        notes.append("the cache holds no hidden states: no CKA and no final-state agreement")
    if final is not None and final not in reader.spec.hidden_layers:
        raise EvaluationError(f"teacher layer {final} is not in the cache (it holds {list(reader.spec.hidden_layers)})")
    if kind == "encoder" and reader.spec.logits:
        notes.append("the cache has logits but the student is not a causal LM: logit metrics skipped")
    if kind == "causal_lm" and not reader.spec.logits:
        notes.append("the cache holds no teacher logits: perplexity only (no top-1 agreement, no KL)")


class _EvalState:
    """What one pass over the cache accumulates: CKA sums, LM sums, pooled final states."""

    def __init__(self, kind: str, logits: str | None, student_layers: list[int], teacher_layers: list[int],
                 final: int | None):
        self.kind, self.final = kind, final
        self.cka = CkaMatrix(student_layers, teacher_layers) if teacher_layers else None
        self.lm = LmStats(logits) if kind == "causal_lm" else None
        self.pooled_s: list[torch.Tensor] = []  # [B, d_s] per batch: the student's last layer, mean-pooled
        self.pooled_t: list[torch.Tensor] = []  # [B, d_t]: the teacher's final cached layer
        self.notes: list[str] = []

    def update(self, out: Any, ids: torch.Tensor, mask: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        valid = mask.bool().to(out.hidden_states[0].device)
        if self.cka is not None:
            student = {j: h[valid].float() for j, h in enumerate(out.hidden_states)}
            teacher = {j: targets[f"hidden/{j}"][valid] for j in self.cka.teacher_layers}
            self.cka.update(student, teacher)
        if self.lm is not None:
            self.lm.update(out.logits, ids.to(valid.device), mask.to(valid.device), targets)
        if self.kind == "encoder" and self.final is not None:
            self.pooled_s.append(mean_pool(out.hidden_states[-1].float().cpu(), mask))
            self.pooled_t.append(mean_pool(targets[f"hidden/{self.final}"].cpu(), mask))

    def result(self, pairs: list[tuple[int, int]], projectors: dict[str, torch.Tensor], depth: int
               ) -> dict[str, Any]:
        result: dict[str, Any] = {"kind": self.kind, "teacher_layer": self.final, "layer_map": [list(p) for p in pairs]}
        if self.lm is not None:
            result.update(self.lm.result())
        if self.pooled_s:
            result.update(self._final_states(projectors, depth))
        if self.cka is not None:
            result["cka"] = _cka_result(self.cka, pairs)
        result["notes"] = self.notes
        return result

    def _final_states(self, projectors: dict[str, torch.Tensor], depth: int) -> dict[str, Any]:
        """Cosine and Spearman of mean-pooled final states (cosine through the projector when widths differ)."""
        student, teacher = torch.cat(self.pooled_s), torch.cat(self.pooled_t)
        out: dict[str, Any] = similarity_agreement(student, teacher)
        key = f"layers.s{depth}_t{self.final}"
        if student.shape[-1] != teacher.shape[-1]:
            if f"{key}.weight" in projectors:
                # Mean pooling commutes with an affine map, so projecting pooled states equals pooling projected ones.
                w, b = projectors[f"{key}.weight"].double(), projectors[f"{key}.bias"].double()
                projected = student.double() @ w.T + b
                out["cosine"] = float(F.cosine_similarity(projected, teacher.double()).mean())
                out["cosine_through"] = f"projector s{depth}_t{self.final}"
            else:
                self.notes.append(f"widths differ (student {student.shape[-1]}, teacher {teacher.shape[-1]}) and "
                                  f"the run has no projector for pair ({depth}, {self.final}): cosine skipped")
        out["sentences"] = int(student.shape[0])
        return out


def _cka_result(cka: CkaMatrix, pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """The CKA matrix and its values on the layer map (None where the eval cache lacks the teacher layer)."""
    matrix = cka.matrix()
    rows = {s: i for i, s in enumerate(cka.student_layers)}
    cols = {t: k for k, t in enumerate(cka.teacher_layers)}
    on_map = [{"student": s, "teacher": t,
               "cka": float(matrix[rows[s], cols[t]]) if s in rows and t in cols else None} for s, t in pairs]
    known = [p["cka"] for p in on_map if p["cka"] is not None]
    last_s, last_t = cka.student_layers[-1], cka.teacher_layers[-1]
    return {"student_layers": cka.student_layers, "teacher_layers": cka.teacher_layers,
            "matrix": matrix.round(6).tolist(), "on_map": on_map,
            "mean_on_map": float(np.mean(known)) if known else None,
            "final": float(matrix[rows[last_s], cols[last_t]]), "tokens": int(cka.n)}
