"""Train small tokenizers offline (no hub) for the tiny models of the embedded default.

Three families, each trained on :func:`paco.models.corpus.corpus_lines` and returned as the
transformers class the real checkpoints use, so ``save_pretrained`` / ``from_pretrained`` work
exactly as with a downloaded model:

* :func:`train_qwen_tokenizer` -> ``Qwen2Tokenizer`` (byte-level BPE, Qwen's pre-tokenizer
  regex, the Qwen2.5-VL special tokens and a Qwen2.5-VL chat template with image items);
* :func:`train_clip_tokenizer` -> ``CLIPTokenizer`` (lower-cased byte-level BPE with ``</w>``
  end-of-word suffixes, ``<|startoftext|>`` / ``<|endoftext|>``);
* :func:`train_t5_tokenizer` -> ``T5Tokenizer`` (a sentencepiece unigram model, ``<pad>`` = 0,
  ``</s>`` = 1, ``<unk>`` = 2, with sentencepiece's precompiled NFKC normaliser).

In transformers 5 the ``...Fast`` names are aliases of these classes (``tokenizers``-backed).
Training is single-threaded and the corpus is fixed, so the same call writes byte-identical
tokenizer files every time.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from paco.models.corpus import corpus_lines

#: Qwen2.5-VL's added special tokens, in the order of the released tokenizer (ids follow the
#: regular vocabulary). ``<|endoftext|>`` is the pad token; ``<|im_end|>`` ends a turn.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: Qwen2.5-VL's chat template: string or list content; ``{"type": "image"}`` items become
#: ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor expands ``<|image_pad|>`` to
#: one token per merged visual patch); a default system turn is inserted when none is given.
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The pre-tokenizer regex of Qwen2 (transformers.models.qwen2.tokenization_qwen2).
_QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_CLIP_PRETOKENIZE_REGEX = (
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)


class TokenizerTrainingError(RuntimeError):
    """A trained tokenizer does not have a property the pipeline relies on."""


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE, sorted (a fixed order)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _bpe_pipeline(clip: bool):
    """The normaliser and pre-tokenizer of the Qwen2 / CLIP tokenizers (as in transformers)."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    if clip:
        normalizer = normalizers.Sequence(
            [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
        )
        pre = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_CLIP_PRETOKENIZE_REGEX), behavior="removed", invert=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        normalizer = normalizers.NFC()
        pre = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return normalizer, pre


def _train_bpe(lines: Sequence[str], vocab_size: int, *, clip: bool,
               min_frequency: int = 2) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a byte-level BPE; return ``(tokens, merges)``.

    A small pure-Python trainer instead of ``tokenizers.trainers.BpeTrainer``: the latter breaks
    ties between equally frequent pairs by hash-map order, which changes from one process to the
    next (two runs gave different ``merges``). Here a tie goes to the lexicographically smallest
    pair, so the result depends only on the corpus.

    Returns:
        ``tokens``: the 256 byte symbols (sorted; for CLIP followed by the same with ``</w>``),
        then one new token per merge, in merge order. ``merges``: the merge rules in order.
    """
    from collections import Counter, defaultdict

    normalizer, pre = _bpe_pipeline(clip)
    words: Counter[str] = Counter()
    for line in lines:
        for piece, _ in pre.pre_tokenize_str(normalizer.normalize_str(line)):
            words[piece] += 1

    alphabet = _byte_alphabet()
    tokens = list(alphabet) + ([a + "</w>" for a in alphabet] if clip else [])
    known = set(tokens)
    symbols: list[list[str]] = []
    freqs: list[int] = []
    for word in sorted(words):
        syms = list(word)
        if clip:
            syms[-1] += "</w>"
        symbols.append(syms)
        freqs.append(words[word])

    counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, syms in enumerate(symbols):
        for pair in zip(syms, syms[1:]):
            counts[pair] += freqs[i]
            where[pair].add(i)

    merges: list[tuple[str, str]] = []
    while len(tokens) < vocab_size and counts:
        best = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        pair, count = best
        if count < min_frequency:
            break
        merged = pair[0] + pair[1]
        merges.append(pair)
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        for i in sorted(where.pop(pair, ())):
            syms, f = symbols[i], freqs[i]
            for p in zip(syms, syms[1:]):  # remove this word's old pairs
                counts[p] -= f
                if counts[p] <= 0:
                    del counts[p]
            out, j = [], 0
            while j < len(syms):
                if j + 1 < len(syms) and syms[j] == pair[0] and syms[j + 1] == pair[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(syms[j])
                    j += 1
            symbols[i] = out
            for p in zip(out, out[1:]):  # add its new pairs
                counts[p] += f
                where[p].add(i)
        counts.pop(pair, None)
    return tokens, merges


def train_qwen_tokenizer(vocab_size: int = 1024, lines: Sequence[str] | None = None):
    """Train a Qwen2-style byte-level BPE tokenizer with the Qwen2.5-VL special tokens.

    Args:
        vocab_size: target size of the BPE vocabulary before the special tokens are added (the
            trainer stops earlier if the corpus has no more pairs of frequency >= 2).
        lines: training text; default :func:`paco.models.corpus.corpus_lines`.

    Returns:
        ``transformers.Qwen2Tokenizer`` with ``eos_token="<|im_end|>"``,
        ``pad_token="<|endoftext|>"``, the special tokens of :data:`QWEN_SPECIAL_TOKENS` (ids
        ``>= vocab size``) and :data:`QWEN_CHAT_TEMPLATE`. ``len(tokenizer)`` is the number of
        token ids (model ``vocab_size``).

    Raises:
        TokenizerTrainingError: ``"Yes"``, ``" Yes"``, ``"No"`` or ``" No"`` is not a single token
            (the judge reads its verdict from the first answer token's logits).
    """
    from transformers import Qwen2Tokenizer

    tokens, merges = _train_bpe(corpus_lines() if lines is None else lines, vocab_size, clip=False)
    # Special tokens take the ids right after the BPE vocabulary, in Qwen's order
    # (<|endoftext|>, <|im_start|>, <|im_end|>, ...), as in the released tokenizer.
    vocab = {t: i for i, t in enumerate(tokens + list(QWEN_SPECIAL_TOKENS))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        model_max_length=32768,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    for word in ("Yes", " Yes", "No", " No"):
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise TokenizerTrainingError(f"{word!r} is {len(ids)} tokens, not one: {ids}")
    return tokenizer


def train_clip_tokenizer(vocab_size: int = 1024, lines: Sequence[str] | None = None):
    """Train a CLIP-style lower-cased byte-level BPE tokenizer with ``</w>`` word ends.

    The vocabulary is laid out like OpenAI CLIP's: the 256 byte symbols, the same with
    ``</w>``, the learned merges, then ``<|startoftext|>`` and ``<|endoftext|>`` last.

    Args:
        vocab_size: target number of BPE tokens (byte symbols + merges) before the two specials.
        lines: training text; default :func:`paco.models.corpus.corpus_lines`.

    Returns:
        ``transformers.CLIPTokenizer`` (bos ``<|startoftext|>``, eos = pad = unk
        ``<|endoftext|>``, ``model_max_length=77``).
    """
    from transformers import CLIPTokenizer

    tokens, merges = _train_bpe(corpus_lines() if lines is None else lines, vocab_size, clip=True)
    tokens = tokens + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def train_t5_tokenizer(vocab_size: int = 1000, lines: Sequence[str] | None = None, *,
                       extra_ids: int = 0):
    """Train a T5 tokenizer from a sentencepiece unigram model (trained in memory).

    Args:
        vocab_size: sentencepiece vocabulary size including ``<pad>``, ``</s>``, ``<unk>``
            (a soft limit: a small corpus may give fewer pieces).
        lines: training text; default :func:`paco.models.corpus.corpus_lines`.
        extra_ids: number of ``<extra_id_N>`` sentinel tokens appended (T5 uses 100; FLUX's
            text encoder never sees them, so the tiny build uses 0).

    Returns:
        ``transformers.T5Tokenizer`` (``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2; appends
        ``</s>`` to every sequence), with the sentencepiece NFKC normaliser.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    from transformers import T5Tokenizer

    lines = list(corpus_lines() if lines is None else lines)
    buf = io.BytesIO()
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="unigram",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        num_threads=1,
        normalization_rule_name="nmt_nfkc",
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(buf.getvalue())
    vocab = [(p.piece, float(p.score)) for p in proto.pieces]
    if [v[0] for v in vocab[:3]] != ["<pad>", "</s>", "<unk>"]:
        raise TokenizerTrainingError(f"unexpected T5 special pieces {vocab[:3]}")
    return T5Tokenizer(
        vocab=vocab,
        extra_ids=extra_ids,
        _spm_precompiled_charsmap=proto.normalizer_spec.precompiled_charsmap,
        model_max_length=512,
    )
