"""Agreement metrics between a student and cached teacher targets: pure functions and running sums, no I/O.

* sentence embeddings: mean pooling, the cosine of pooled states, the Spearman correlation of the two models'
  pairwise-similarity matrices;
* ``CkaMatrix``: exact linear CKA between every student layer and every cached teacher layer, streamed;
* ``LmStats``: perplexity, top-1 agreement and KL(teacher || student) of a language-model head, with the
  causal shift (position i predicts token i+1) or without it (an encoder-decoder's labels are already aligned).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from kdcache.stages.targets.logits import KlSetup, LogitKind
from kdcache.stages.targets.logits.teacher_head import TeacherHead
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.core.masks import TokenMasks


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, d]`` sentence embeddings: the mean of ``hidden [B, L, d]`` over the real tokens of ``mask [B, L]``."""
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


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
        # Per side key its rows' sum and Gram matrix, per pair key its cross products; 0 until the first batch.
        self.sums: defaultdict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self.grams: defaultdict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))

    def update(self, student: dict[int, torch.Tensor], teacher: dict[int, torch.Tensor]) -> None:
        """Add one batch. Args: ``{layer: [N_v, d]}`` valid-token rows of each side (same N_v, same order)."""
        sides = {f"s{j}": v.double() for j, v in student.items()}
        sides.update({f"t{j}": v.double() for j, v in teacher.items()})
        self.n += next(iter(sides.values())).shape[0]
        for key, rows in sides.items():  # never in place: the first batch's sum replaces the 0-dim zero
            self.sums[key] = self.sums[key] + rows.sum(0)
            self.grams[key] = self.grams[key] + rows.T @ rows
        for s in self.student_layers:
            for t in self.teacher_layers:
                self.grams[f"t{t}s{s}"] = self.grams[f"t{t}s{s}"] + sides[f"t{t}"].T @ sides[f"s{s}"]

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


class LmStats:
    """Running sums of the LM metrics: NLL of the labels, top-1 agreement and KL to the teacher.

    Args:
        kind: the cached teacher logits' kind (the cache's, ``logit_kinds.of(spec.logit_layout)``), or None
            (no teacher logits: perplexity only).
        shift: position i predicts token i+1 (causal LMs); False when logits[i] already predicts ids[i]
            (encoder-decoders, whose decoder ids are the labels).
        head: for a kind that needs it (``--logits head``), the teacher's LM head (``teacher_head.TeacherHead``),
            applied to its cached last layer.
        sample_temperature: the cache's sampling temperature (the KL of a sampled cache exists only there).
    """

    def __init__(self, kind: LogitKind | None, shift: bool = True, head: TeacherHead | None = None,
                 sample_temperature: float = 1.0):
        self.kind = kind
        self.shift, self.head = shift, head
        self.sample_temperature = sample_temperature
        self.nll = self.predicted = self.agree = self.kl = self.tokens = 0.0

    def update(self, logits: torch.Tensor | HeadLogits, ids: torch.Tensor, masks: TokenMasks,
               targets: dict[str, torch.Tensor]) -> None:
        """Add one batch: student ``logits [B, L, V]``, ``ids [B, L]``, the positions counted (the same as
        training's, ``masks.token_masks``), cached targets. ``HeadLogits`` (the run's loss applies the student's head
        itself) are built whole here: an evaluation batch is small enough to hold them."""
        if isinstance(logits, HeadLogits):
            logits = F.linear(logits.hidden, logits.weight, logits.bias)
        logits = logits.float()
        step = 1 if self.shift else 0
        pairs = masks.pairs if self.shift else masks.trained  # position i predicts token i+step
        log_probs = F.log_softmax(logits[:, :logits.shape[1] - step][pairs], dim=-1)
        self.nll -= float(log_probs.gather(1, ids[:, step:][pairs][:, None]).sum())
        self.predicted += int(pairs.sum())
        if self.kind is None:
            return
        valid = masks.predicts
        n_valid = int(valid.sum())
        if n_valid == 0:  # nothing of this batch is trained on
            return
        self.agree += int((logits[valid].argmax(-1) == self.kind.teacher_top1(targets, valid, self.head)).sum())
        setup = KlSetup(self.sample_temperature, head=self.head)
        # the kinds' KLs return a mean over valid tokens
        self.kl += float(self.kind.eval_kl(logits, targets, valid, setup)) * n_valid
        self.tokens += n_valid

    def result(self) -> dict[str, Any]:
        """``perplexity``, and with teacher logits ``top1_agreement`` and ``kl`` (nats per valid token)."""
        out: dict[str, Any] = {"perplexity": float(np.exp(self.nll / max(1.0, self.predicted))),
                               "predicted_tokens": int(self.predicted)}
        if self.kind is not None:
            out.update(top1_agreement=self.agree / max(1.0, self.tokens), kl=self.kl / max(1.0, self.tokens),
                       kl_form=self.kind.kl_label(self.sample_temperature),
                       tokens=int(self.tokens))
        return out


def final_state_agreement(student: torch.Tensor, teacher: torch.Tensor, projectors: dict[str, torch.Tensor],
                          depth: int, final: int | None, notes: list[str]) -> dict[str, Any]:
    """Compare the mean-pooled final states of the same sentences: ``spearman`` of the two models' off-diagonal
    pairwise cosine similarities, and ``cosine``, the mean per-sentence cosine, through the run's projector of pair
    ``(depth, final)`` when the widths differ (a note says so when there is none).

    Args:
        student: ``[n, d_s]`` pooled final states of the student (``depth`` is its last layer).
        teacher: ``[n, d_t]`` pooled states of teacher layer ``final``.
        projectors: the run's projector weights (``layers.s{depth}_t{final}.weight`` / ``.bias``), or empty.
    """
    def pairwise(emb: torch.Tensor) -> np.ndarray:
        unit = F.normalize(emb.double(), dim=-1)
        sims = (unit @ unit.T).numpy()
        return sims[np.triu_indices(len(sims), k=1)]

    # scipy's Spearman, with average ranks for ties
    out: dict[str, Any] = {"spearman": float(spearmanr(pairwise(student), pairwise(teacher)).statistic)}
    key = f"layers.s{depth}_t{final}"
    if student.shape[-1] == teacher.shape[-1]:
        out["cosine"] = float(F.cosine_similarity(student.double(), teacher.double()).mean())
    elif f"{key}.weight" in projectors:
        # Mean pooling commutes with an affine map, so projecting pooled states equals pooling projected ones.
        w, b = projectors[f"{key}.weight"].double(), projectors[f"{key}.bias"].double()
        projected = student.double() @ w.T + b
        out["cosine"] = float(F.cosine_similarity(projected, teacher.double()).mean())
        out["cosine_through"] = f"projector s{depth}_t{final}"
    else:
        notes.append(f"widths differ (student {student.shape[-1]}, teacher {teacher.shape[-1]}) and "
                     f"the run has no projector for pair ({depth}, {final}): cosine skipped")
    out["sentences"] = int(student.shape[0])
    return out


def cka_result(cka: CkaMatrix, pairs: list[tuple[int, int]]) -> dict[str, Any]:
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
