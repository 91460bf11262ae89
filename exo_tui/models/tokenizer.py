"""The model's tokenizer, built from the GGUF file's own ``tokenizer.ggml.*`` fields.

Two vocabulary kinds are read, as llama.cpp reads them:

* ``gpt2`` — byte-level BPE (SmolLM, Llama 3, Qwen, ...): the text is split by the
  pre-tokenizer regexes that llama.cpp uses for ``tokenizer.ggml.pre``, each piece is mapped
  byte by byte to GPT-2's printable alphabet and merged by the file's merge list.
* ``llama`` — SentencePiece BPE with scores (Llama 1/2, Mistral, TinyLlama): spaces become
  ``▁``, a ``▁`` is prepended, pieces merge by score, and unknown characters fall back to the
  ``<0xXX>`` byte tokens.

The work is done by the HuggingFace ``tokenizers`` library (no ``transformers``, no hub).
Control tokens (``token_type`` 3, e.g. ``<|im_start|>``) and user-defined tokens (type 4) are
matched whole in the text, never split.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from exo_tui.models.gguf_file import GGUFModel

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# End-of-generation tokens besides tokenizer.ggml.eos_token_id, as llama.cpp collects them.
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eom_id|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<end_of_utterance>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
)

# ------------------------------------------------------------------ pre-tokenizer regexes
# The pieces llama.cpp (src/llama-vocab.cpp) splits text into before BPE, per tokenizer.ggml.pre.
# Each list is applied in turn; text between matches is kept as its own piece.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is not merged (llama 3, tekken)
    add_bos: bool = False  # llama.cpp's default when the file does not say


_SMOLLM = PreTokenizer((r"\p{N}", _GPT2))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    "gpt2": PreTokenizer((_GPT2,)),
    "gpt-2": PreTokenizer((_GPT2,)),
    "phi-2": PreTokenizer((_GPT2,)),
    "mpt": PreTokenizer((_GPT2,)),
    "olmo": PreTokenizer((_GPT2,)),
    "jais": PreTokenizer((_GPT2,)),
    "exaone4": PreTokenizer((_GPT2,)),
    "smollm": _SMOLLM,
    "starcoder": _SMOLLM,
    "refact": _SMOLLM,
    "command-r": _SMOLLM,
    "codeshell": _SMOLLM,
    "exaone": _SMOLLM,
    "minerva-7b": _SMOLLM,
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "falcon3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "pixtral": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "chatglm-bpe": PreTokenizer((_LLAMA3,)),
    "glm4": PreTokenizer((_LLAMA3,)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
    "megrez": PreTokenizer((_QWEN2,)),
    "stablelm2": PreTokenizer((_QWEN2,)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt-4o": PreTokenizer((_GPT4O,)),
    "llama4": PreTokenizer((_GPT4O,)),
    "bloom": PreTokenizer((_BLOOM,)),
    "poro-chat": PreTokenizer((_BLOOM,)),
    "gpt3-finnish": PreTokenizer((_BLOOM,)),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
}


class TokenizerError(Exception):
    """The model file's tokenizer cannot be used; the message names the file and what to do."""


class BadText(ValueError):
    """Text that is not Unicode a model can read (a lone surrogate, as JSON's ``"\\ud800"`` makes);
    ``what`` names the text (``messages[1].content``), or is empty."""

    def __init__(self, message: str, what: str = "") -> None:
        super().__init__(message)
        self.what = what


class PromptTooLong(ValueError):
    """A text that holds at least ``at_least`` tokens, ``limit`` or more, found before tokenizing it."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the prompt holds at least {at_least} tokens; at most {limit - 1} fit")
        self.at_least, self.limit = at_least, limit


def check_text(text: str, what: str = "") -> None:
    """:class:`BadText` unless ``text`` is encodable Unicode (no lone surrogates), naming ``what``."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadText(f"{what or 'the text'} holds a lone surrogate (U+{ord(text[exc.start]):04X} at character "
                      f"{exc.start}), which is not a Unicode character: send valid UTF-8 text (a surrogate pair, "
                      "\\ud83d\\ude00, is one character)", what) from None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


# str.translate table: GPT-2 alphabet character -> the latin-1 character of its byte
_BYTE_LEVEL_TABLE = {ord(ch): chr(b) for b, ch in bytes_to_unicode().items()}
_BYTE_LEVEL_CHARS = frozenset(bytes_to_unicode().values())


def _byte_level_piece(token: str) -> bytes:
    try:
        return token.translate(_BYTE_LEVEL_TABLE).encode("latin-1")
    except UnicodeEncodeError:  # a character outside GPT-2's alphabet stands for itself
        return b"".join(
            ch.translate(_BYTE_LEVEL_TABLE).encode("latin-1") if ch in _BYTE_LEVEL_CHARS else ch.encode("utf-8")
            for ch in token
        )


def _spm_piece(token: str, token_type: int) -> bytes:
    if token_type == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("▁", " ").encode("utf-8")


class Tokenizer:
    """Text to token ids and back, exactly as the model was trained to read them."""

    def __init__(
        self,
        *,
        kind: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | np.ndarray,
        hf_builder: Callable[[], Any],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool,
        strip_leading_space: bool,
        source: str,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self.kind = kind
        self.source = source
        self._tokens = list(tokens)
        self._types = np.asarray(token_types, dtype=np.int32)
        self._build_hf = hf_builder
        self._hf = hf_builder()
        self._hf_plain: Any = None  # lazily built twin that does not match control tokens
        self._hf_lock = threading.Lock()
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        # SentencePiece decoding drops the space that encoding prepended
        self.strip_leading_space = strip_leading_space
        if kind == "gpt2":
            self._pieces = [
                t.encode("utf-8") if ty in (CONTROL, USER_DEFINED) else _byte_level_piece(t)
                for t, ty in zip(self._tokens, self._types.tolist(), strict=True)
            ]
        else:
            self._pieces = [
                t.encode("utf-8") if ty in (CONTROL, USER_DEFINED, UNKNOWN) else _spm_piece(t, ty)
                for t, ty in zip(self._tokens, self._types.tolist(), strict=True)
            ]
        self._special = frozenset(np.flatnonzero(self._types == CONTROL).tolist())
        self.max_token_bytes = max((len(p) for p in self._pieces), default=1) or 1
        control = sorted({self._tokens[i] for i in self._special if self._tokens[i]}, key=len, reverse=True)
        # leftmost, then longest: how the HF tokenizer matches its added tokens in the text
        self._control_re = re.compile("|".join(map(re.escape, control))) if control else None
        self._ids: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            self._ids.setdefault(t, i)  # the first id of a text that appears twice, as encode uses
        eos = {eos_id} if eos_id is not None else set()
        eos.update(extra_eos_ids)
        for text in END_OF_TURN_TEXTS:
            end = self._ids.get(text)
            if end is not None and self._types[end] in (CONTROL, USER_DEFINED):
                eos.add(end)
        self.eos_ids: frozenset[int] = frozenset(eos)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, model: GGUFModel) -> Tokenizer:
        """The tokenizer of an opened GGUF file (about 0.3 s for a 49k-token vocabulary)."""
        keys = (
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token",
            "tokenizer.ggml.add_space_prefix",
        )
        fields: dict[str, Any] = {k: model.field(k) for k in keys}
        for k in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            fields[k] = model.field_array(k)
        return cls.from_fields(fields, source=str(model.path))

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], *, source: str = "the model file") -> Tokenizer:
        """Build from ``tokenizer.ggml.*`` metadata given as a mapping (missing keys: ``None``)."""

        def get(key: str, default: Any = None) -> Any:
            value = fields.get(key)
            return default if value is None else value

        kind = str(get("tokenizer.ggml.model", ""))
        tokens = get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise TokenizerError(
                f"{source} has no tokenizer (tokenizer.ggml.tokens is missing): "
                "use a GGUF converted with its tokenizer (llama.cpp's convert_hf_to_gguf.py)"
            )
        tokens = [str(t) for t in tokens]
        types = get("tokenizer.ggml.token_type")
        types = np.full(len(tokens), NORMAL, np.int32) if types is None else np.asarray(types, np.int32)
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; "
                "the file is corrupt: convert or download it again"
            )

        def token_id(key: str) -> int | None:
            value = get(key)
            if value is None:
                return None
            value = int(value)
            return value if 0 <= value < len(tokens) else None

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        extra_eos = [i for i in (token_id("tokenizer.ggml.eot_token_id"), token_id("tokenizer.ggml.eom_token_id")) if i is not None]
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False))

        if kind == "gpt2":
            pre_name = str(get("tokenizer.ggml.pre", "default"))
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                log.warning(
                    "%s: unknown pre-tokenizer %r; splitting text as llama.cpp's 'default' does "
                    "(tokens may differ from the model's training)", source, pre_name
                )
                pre = PRE_TOKENIZERS["default"]
            merges = get("tokenizer.ggml.merges")
            if merges is None:
                raise TokenizerError(
                    f"{source}: a gpt2 (BPE) tokenizer needs tokenizer.ggml.merges, which is missing: "
                    "convert the model again with llama.cpp's convert_hf_to_gguf.py"
                )
            add_bos = bool(get("tokenizer.ggml.add_bos_token", pre.add_bos))
            builder = _byte_level_builder(tokens, list(merges), types, pre)
            strip = False
        elif kind == "llama":
            scores = get("tokenizer.ggml.scores")
            scores = np.zeros(len(tokens), np.float32) if scores is None else np.asarray(scores, np.float32)
            add_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
            add_bos = bool(get("tokenizer.ggml.add_bos_token", True))
            unk_id = token_id("tokenizer.ggml.unknown_token_id")
            if unk_id is None:
                unk_id = next((i for i, t in enumerate(types.tolist()) if t == UNKNOWN), None)
            unk = tokens[unk_id] if unk_id is not None else None
            builder = _sentencepiece_builder(tokens, scores, types, add_prefix, unk)
            strip = add_prefix
        else:
            raise TokenizerError(
                f"{source} uses a {kind or 'missing'!r} tokenizer (tokenizer.ggml.model); exo-tui reads "
                "'gpt2' (byte-level BPE) and 'llama' (SentencePiece) tokenizers: choose another model file"
            )
        return cls(
            kind=kind,
            tokens=tokens,
            token_types=types,
            hf_builder=builder,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos and bos_id is not None,
            add_eos=add_eos and eos_id is not None,
            strip_leading_space=strip,
            source=source,
            extra_eos_ids=extra_eos,
        )

    # ------------------------------------------------------------------ use

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound of ``len(encode(text))``, without tokenizing: no token stands for more
        than ``max_token_bytes`` bytes, and a character is at least one byte."""
        return -(-len(text) // self.max_token_bytes)

    def has_control_text(self, text: str) -> bool:
        """Whether ``text`` spells a control token (``<|im_end|>``)."""
        return self._control_re is not None and self._control_re.search(text) is not None

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True, *,
               plain: Sequence[tuple[int, int]] = (), limit: int | None = None) -> list[int]:
        """Token ids of ``text``.

        ``add_special``: put BOS first (and EOS last) when the model asks for it
        (``tokenizer.ggml.add_bos_token``), unless the text already starts with BOS — so a chat
        template that writes ``{{ bos_token }}`` itself does not get two.
        ``parse_special``: control tokens written in the text (``<|im_start|>``) become their ids;
        with ``False`` they are tokenized as plain text (use it for untrusted text).
        ``plain``: ``(start, end)`` character ranges where control tokens are plain text even so
        (a chat's message contents inside the template's markup).
        ``limit``: :class:`PromptTooLong` at once, before tokenizing, when the text cannot have
        fewer than ``limit`` tokens (:meth:`fewest_tokens`). :class:`BadText` for lone surrogates.

        The GIL is released while the HF tokenizer works (its batch call), so a thread tokenizing
        a long text does not stall the caller's event loop.
        """
        if limit is not None and self.fewest_tokens(text) >= limit:
            raise PromptTooLong(self.fewest_tokens(text), limit)
        check_text(text)
        if plain and parse_special and self._control_re is not None:
            ids = self._encode_outside(text, plain)
        else:
            hf = self._hf if parse_special else self._plain()
            ids = hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special:
            if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def _encode_outside(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
        """Control tokens matched only outside ``plain``; the text between them tokenized as
        the HF tokenizer tokenizes the pieces between the control tokens it matches."""
        assert self._control_re is not None
        pieces: list[str] = []
        marks: list[int] = []  # control token ids, one after each piece but the last
        at = 0
        for m in self._control_re.finditer(text):
            if any(s < m.end() and m.start() < e for s, e in plain):
                continue  # spelled inside a message: text
            pieces.append(text[at:m.start()])
            marks.append(self._ids[m.group()])
            at = m.end()
        pieces.append(text[at:])
        encoded = self._plain().encode_batch(pieces, add_special_tokens=False)
        ids: list[int] = []
        for i, enc in enumerate(encoded):
            ids.extend(enc.ids)
            if i < len(marks):
                ids.append(marks[i])
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of ``ids``; invalid UTF-8 (a character cut in two) becomes U+FFFD."""
        data = b"".join(self.iter_pieces(ids, skip_special))
        return data.decode("utf-8", errors="replace")

    def iter_pieces(self, ids: Iterable[int], skip_special: bool = False) -> Iterable[bytes]:
        """The bytes of each token in turn, as :meth:`decode` joins them."""
        first = True
        for i in ids:
            if skip_special and i in self._special:
                continue
            piece = self.token_bytes(i)
            if first:
                first = False
                if self.strip_leading_space and piece.startswith(b" "):
                    piece = piece[1:]
            yield piece

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte-level token may hold part of a character)."""
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._pieces)} tokens of {self.source}")
        return self._pieces[token_id]

    def token_text(self, token_id: int) -> str:
        """The token's entry in the vocabulary as stored (``Ġ``/``▁`` for spaces)."""
        return self._tokens[token_id]

    def token_id(self, text: str) -> int | None:
        """The id of a vocabulary entry given as stored (``"ĠParis"``, ``"<|im_end|>"``), or None."""
        return self._ids.get(text)

    def is_special(self, token_id: int) -> bool:
        """A control token (``token_type`` 3: BOS, EOS, ``<|im_start|>``, ...)."""
        return token_id in self._special

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def _plain(self) -> Any:
        with self._hf_lock:
            if self._hf_plain is None:
                hf = self._build_hf()
                hf.encode_special_tokens = True
                self._hf_plain = hf
            return self._hf_plain

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, {self.vocab_size} tokens, from {self.source})"


# ---------------------------------------------------------------------- HF tokenizer builders


def _add_matched_tokens(hf: Any, tokens: list[str], types: np.ndarray) -> None:
    from tokenizers import AddedToken

    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types.tolist(), strict=True) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types.tolist(), strict=True) if ty == USER_DEFINED]
    if control:
        hf.add_special_tokens(control)
    if user:
        hf.add_tokens(user)


def _byte_level_builder(
    tokens: list[str], merges: list[str], types: np.ndarray, pre: PreTokenizer
) -> Callable[[], Any]:
    def build() -> Any:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if sep:
                pairs.append((a, b))
        hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        _add_matched_tokens(hf, tokens, types)
        return hf

    return build


def _sentencepiece_merges(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges equivalent to merging by score: every split of a token into two tokens, the
    merges of higher-scoring tokens first (as HF's SentencePiece converter derives them)."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if types[i] in (NORMAL, USER_DEFINED):
            vocab.setdefault(t, i)
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(scores[i]), li, ri, left, right))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def _sentencepiece_builder(
    tokens: list[str], scores: np.ndarray, types: np.ndarray, add_prefix: bool, unk: str | None
) -> Callable[[], Any]:
    merges = _sentencepiece_merges(tokens, scores, types)

    def build() -> Any:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, normalizers

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        hf = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps: list[normalizers.Normalizer] = [normalizers.Prepend("▁")] if add_prefix else []
        steps.append(normalizers.Replace(" ", "▁"))
        hf.normalizer = normalizers.Sequence(steps)
        _add_matched_tokens(hf, tokens, types)
        return hf

    return build
