"""What a seq2seq (encoder-decoder) teacher's cache holds, resolved against the teacher's config.

Layer numbering is HF's on each side: ``encoder_hidden_states[j]`` / ``decoder_hidden_states[j]`` (0 =
embeddings), and attention block j is ``encoder_attentions[j-1]``, ``decoder_attentions[j-1]`` or
``cross_attentions[j-1]``.

Flags, and why they default the way they do:

* ``--layers`` selects hidden layers on both sides (the common case: "layers 2 and 4 of each stack");
  ``--encoder-layers`` / ``--decoder-layers`` override one side, and ``none`` drops a side.
* ``--attention-layers`` selects self-attention blocks on both sides (default: each side's hidden blocks);
  ``--encoder-attention-layers`` / ``--decoder-attention-layers`` override one side.
* feature ``cross_attention`` adds cross-attention maps, by default at the decoder's self-attention blocks
  (or its hidden blocks), since those are the layers a student's decoder is matched on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import PrecomputeOptions, parse_layers


@dataclass(frozen=True)
class Seq2SeqTargets:
    """Concrete layers, heads and logits of one seq2seq precompute."""

    encoder_hidden: tuple[int, ...]
    encoder_attention: tuple[int, ...]
    decoder_hidden: tuple[int, ...]
    decoder_attention: tuple[int, ...]
    cross_attention: tuple[int, ...]
    heads: tuple[int, ...] | None
    logits: str | None
    top_k: int
    vocab_size: int
    encoder_depth: int
    decoder_depth: int

    @property
    def wants_attention(self) -> bool:
        """Whether any attention map is captured (the teacher then needs eager attention)."""
        return bool(self.encoder_attention or self.decoder_attention or self.cross_attention)

    @property
    def wants_hidden(self) -> bool:
        return bool(self.encoder_hidden or self.decoder_hidden)


def seq2seq_depths(config: Any) -> tuple[int, int, int]:
    """``(encoder blocks, decoder blocks, heads)`` of BART/mBART (``encoder_layers``) or T5 (``num_layers``).

    Heads is the smaller of the two sides' counts, so a head subset valid for it is valid everywhere.
    """
    encoder: int | None = getattr(config, "encoder_layers", None) or getattr(config, "num_layers", None)
    decoder = getattr(config, "decoder_layers", None) or getattr(config, "num_decoder_layers", None) or encoder
    keys = ("encoder_attention_heads", "decoder_attention_heads", "num_heads")
    heads = [int(h) for h in (getattr(config, k, None) for k in keys) if h]
    if not encoder or not heads:
        raise PrecomputeError(f"cannot read the encoder/decoder depth of a {config.model_type} config")
    return int(encoder), int(decoder or encoder), min(heads)


def _is_none(values: tuple[str, ...] | None) -> bool:
    return values is not None and tuple(v.strip().lower() for v in values) == ("none",)


def _select(values: tuple[str, ...], depth: int, minimum: int, name: str) -> tuple[int, ...]:
    """Parse a layer list (``none`` = no layer) for a stack of ``depth`` blocks."""
    if _is_none(values):
        return ()
    try:
        return parse_layers(values, depth, minimum=minimum, name=name)
    except ValueError as exc:
        raise PrecomputeError(str(exc)) from None


def _side(options: PrecomputeOptions, side: str, depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(hidden layers, self-attention blocks) of the ``side`` ("encoder" or "decoder") stack."""
    hidden_values = getattr(options, f"{side}_layers") or options.layers  # empty: inherit --layers
    hidden = _select(hidden_values, depth, 0, f"{side}_layers") if "hidden" in options.features else ()
    if "attention" not in options.features:
        return hidden, ()
    attention_flag = getattr(options, f"{side}_attention_layers") or options.attention_layers
    if attention_flag is not None:
        return hidden, _select(attention_flag, depth, 1, f"{side}_attention_layers")
    # Default: the blocks of this side's hidden selection (layer 0, the embeddings, has no attention map).
    blocks = tuple(j for j in _select(hidden_values, depth, 0, f"{side}_layers") if j >= 1)
    return hidden, blocks


def resolve_seq2seq_targets(options: PrecomputeOptions, config: Any) -> Seq2SeqTargets:
    """Turn the layer/head/logit options into concrete numbers for this encoder-decoder teacher.

    Raises:
        PrecomputeError: a layer or head out of range, top-k above the vocabulary, a selection that captures
            nothing, or a triangle asked for on the (bidirectional) encoder alone.
    """
    n_enc, n_dec, num_heads = seq2seq_depths(config)
    enc_hidden, enc_attention = _side(options, "encoder", n_enc)
    dec_hidden, dec_attention = _side(options, "decoder", n_dec)
    cross: tuple[int, ...] = ()
    if "cross_attention" in options.features:
        values = options.cross_attention_layers
        cross = _select(values, n_dec, 1, "cross_attention_layers") if values else (
            dec_attention or tuple(j for j in dec_hidden if j >= 1))
        if not cross:
            raise PrecomputeError("cross_attention: no decoder block selected; set --cross-attention-layers")
    if "attention" in options.features and not (enc_attention or dec_attention):
        raise PrecomputeError("attention: no encoder or decoder block selected (only layer 0?); set "
                              "--attention-layers or --encoder-attention-layers/--decoder-attention-layers")
    if options.triangle and not dec_attention:
        raise PrecomputeError("triangle: only the decoder's causal self-attention can be stored as a triangle, "
                              "and no decoder attention block is selected; drop --triangle")
    heads = options.heads if (enc_attention or dec_attention or cross) else None
    if heads is not None and max(heads) >= num_heads:
        raise PrecomputeError(f"heads: head {max(heads)} is out of range; this teacher has heads 0..{num_heads - 1}")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if options.logits_kind == "topk" and options.top_k > vocab:
        raise PrecomputeError(f"top_k {options.top_k} is larger than the teacher's vocabulary of {vocab} tokens")
    top_k = options.top_k if options.logits_kind == "topk" else 0
    return Seq2SeqTargets(enc_hidden, enc_attention, dec_hidden, dec_attention, cross, heads, options.logits_kind,
                          top_k, vocab, n_enc, n_dec)


def build_seq2seq_spec(options: PrecomputeOptions, targets: Seq2SeqTargets, num_sequences: int) -> Any:
    """The two-stream ``CacheSpec`` of this run (storage validates it)."""
    from kdcache.storage import CacheSpec

    return CacheSpec(
        num_sequences=num_sequences, backend=options.format, layout="seq2seq",
        encoder_hidden_layers=targets.encoder_hidden, encoder_attention_layers=targets.encoder_attention,
        decoder_hidden_layers=targets.decoder_hidden, decoder_attention_layers=targets.decoder_attention,
        cross_attention_layers=targets.cross_attention, attention_heads=targets.heads,
        attention_triangle=bool(targets.decoder_attention and options.triangle), logits=targets.logits,
        top_k=targets.top_k, vocab_size=targets.vocab_size if targets.logits else 0, dtype=options.dtype,
        codec=options.codec_config, bitround=options.bitround, sequences_per_shard=options.sequences_per_shard)
