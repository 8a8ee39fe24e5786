"""The loss registry of stage two: every definition of docs/losses.md, by name.

``get_loss(name)`` returns the callable; an unknown name raises ``LossError`` listing ``registered_losses()``.
Signatures by family (``mask [B, L]`` is 1 for a real token everywhere):

* ``ce(logits [B,L,V], input_ids [B,L], mask)`` — causal shift; ``ce_token(logits, labels [B,L], mask)``.
* ``kl(student_logits [B,L,V], teacher_logits [B,L,V], mask, temperature=1.0)``.
* ``topk_kl(student_logits, topk_values [B,L,k], topk_ids [B,L,k], mask, lse [B,L] | None, *, variant,
  temperature)``, and ``topk_kl_renorm`` / ``topk_kl_other`` with the variant fixed.
* ``mse`` / ``cosine`` / ``cka`` / ``cka_sqrt``: ``(h_s [B,L,d], h_t [B,L,d_t], mask)``; ``h_s`` projected to
  ``d_t`` for ``mse`` and ``cosine``, raw for the CKA pair.
* ``attention_kl(a_s [B,H_s,L,L], a_t [B,H_t,L,L], mask)``; from queries and keys, block by block,
  ``qk_loss.blocked_attention_kl`` (and MiniLMv2's ``qk_loss.relation_kl``), in ``stages.targets.attention``.
* ``uld(student_logits [B,K,V_s], topk_values [B,K,k], lse [B,K], mask [B,K])`` and ``gold(..., topk_ids,
  lse, mask, shared [V_t], *, temperature)``: across vocabularies, per aligned span (``cross_vocab``).
* ``wgan(critic, h_s_proj [B,L,d_t], mask)`` — the student side; the critic side is ``critic_loss`` and
  ``CriticTrainer`` of ``stages.targets.hidden.wgan``.
"""

from __future__ import annotations

from collections.abc import Callable

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.targets.hidden.hidden_losses import hidden_loss
from kdcache.stages.targets.logits.full_torch import kd_kl
from kdcache.stages.targets.logits.topk_torch import topk_kl, topk_kl_other, topk_kl_renorm
from kdcache.stages.train.losses.cross_vocab import gold_loss, uld_loss
from kdcache.stages.train.losses.logits import causal_ce, token_ce
from kdcache.storage import Registry  # the option's choices are the registry's names

# Every loss by its term's name. A hidden loss's function is its family object's (``stages.targets.hidden``, the one
# place a hidden loss is defined), listed where the definitions list it.
_DEFINITIONS: list[tuple[str, Callable[..., object]]] = [
    ("ce", causal_ce),
    ("ce_token", token_ce),
    ("kl", kd_kl),
    ("topk_kl", topk_kl),
    ("topk_kl_renorm", topk_kl_renorm),
    ("topk_kl_other", topk_kl_other),
    *((name, hidden_loss(name).resolved()) for name in ("mse", "cosine", "cka", "cka_sqrt")),
    ("attention_kl", attention_kl),
    ("wgan", hidden_loss("wgan").resolved()),
    ("uld", uld_loss),
    ("gold", gold_loss),
]
_REGISTRY: Registry[Callable[..., object]] = Registry("loss", LossError)
_REGISTRY.update(_DEFINITIONS)  # a dict's own update: the registry is a dict of entries by name


def registered_losses() -> list[str]:
    """Every registered loss name, sorted."""
    return sorted(_REGISTRY)


get_loss = _REGISTRY.lookup  # the loss callable registered as a name; LossError listing the registered names otherwise
