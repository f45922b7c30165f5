"""Text <-> token ids for the models kvjax runs, on top of the `tokenizers` library.

Two sources, one class:

- a GGUF file's metadata (`tokenizer.ggml.*`): the vocabulary, BPE merges and token types are
  turned into a `tokenizers.Tokenizer` here. Two kinds are supported: byte-level BPE
  (`tokenizer.ggml.model == "gpt2"`, the GPT-2 / SmolLM2 / Llama-3 family of vocabularies; the
  pre-tokenizer follows llama.cpp's reading of `tokenizer.ggml.pre`), and SentencePiece BPE
  (`"llama"`, e.g. Gemma 3: spaces become "▁", pieces merge best-score first, unknown
  characters fall back to `<0xXX>` byte tokens).
- a local HuggingFace directory (`tokenizer.json` + `tokenizer_config.json`), read with no
  network access.

`encode` adds no special token except a BOS that the model's tokenizer metadata asks for
(`tokenizer.ggml.add_bos_token`, or `add_bos_token` in `tokenizer_config.json`: Gemma sets it,
SmolLM2 and Qwen do not), which is what transformers' tokenizer of the same model does;
HF post-processors are bypassed, and `add_bos=True` / `False` overrides the default, so a
caller always knows what the model sees.

Example:
    >>> from kvjax.models.tokenizer import Tokenizer
    >>> tok = Tokenizer.from_gguf(path)              # or Tokenizer.from_hf_dir("Qwen3-8B/")
    >>> ids = tok.encode("To be, or not to be", add_bos=True)
    >>> tok.decode(ids[1:])
    'To be, or not to be'
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

from kvjax.config import UnsupportedModelError

# llama.cpp token types (gguf.TokenType): which vocabulary entries are matched verbatim in text
# instead of going through BPE.
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# `tokenizer.ggml.pre` values whose split rule is the GPT-2 regex alone.
_PRE_GPT2 = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})
# `tokenizer.ggml.pre` values that first isolate every digit (\p{N}), then apply the GPT-2 regex.
# SmolLM2 ("smollm") is one: its vocabulary has no multi-digit tokens.
_PRE_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r"})
SUPPORTED_GGUF_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_GPT2 | _PRE_DIGITS_THEN_GPT2))


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_GPT2:
        return byte_level
    if pre in _PRE_DIGITS_THEN_GPT2:
        # Order matters: digits are cut out before the regex sees them, so "a  1" splits as
        # "a", "  ", "1" (a two-space token) and not "a", " ", " 1" as plain GPT-2 would.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise UnsupportedModelError(
        f"tokenizer.ggml.pre={pre!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}"
    )


def _add_control_and_user_tokens(backend, tokens, types, skip_user=None) -> None:
    """Control tokens become special (skipped by decode(skip_special=True)); user-defined ones
    stay plain text that must still match as a whole (those flagged in `skip_user` excepted)."""
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, ty in enumerate(types)
            if ty == _TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types)
            if ty == _TOKEN_TYPE_USER_DEFINED and not (skip_user is not None and skip_user[i])
        ]
    )


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token ids a model needs.

    Attributes:
        backend: the wrapped `tokenizers.Tokenizer`.
        bos_id: beginning-of-sequence id, or None when the vocabulary has none.
        eos_ids: ids that end generation (EOS first, then e.g. end-of-turn), possibly empty.
        chat_template: the Jinja chat template shipped with the model, or None.
        add_bos_default: `encode` prepends `bos_id` unless told otherwise (Gemma).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_default: bool = False,
    ):
        self.backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for name, i in [("bos_id", bos_id), *(("eos_ids entry", e) for e in eos_ids)]:
            if i is not None and not 0 <= i < self._vocab_size:
                raise ValueError(f"{name} {i} is outside vocab of size {self._vocab_size}")
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(e) for e in eos_ids))  # dedupe, keep order
        self.chat_template = chat_template
        if add_bos_default and bos_id is None:
            raise ValueError("add_bos_default=True but this tokenizer has no BOS token")
        self.add_bos_default = bool(add_bos_default)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (may be below the embedding rows)."""
        return self._vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}"
            f", add_bos_default={self.add_bos_default})"
        )

    # --- use ----------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in the text map to their ids.

        Args:
            text: the string to tokenize.
            add_bos: prepend `bos_id`; None: `add_bos_default` (what the model's metadata says).

        Raises:
            ValueError: `text` is not a str, or `add_bos` with no BOS token.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
        """`encode` over many strings, parallelised by the Rust backend."""
        bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if bad:
            raise ValueError(f"texts must all be str, got {bad}")
        out = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            out = [[self.bos_id, *ids] for ids in out]
        return out

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of a sequence of ids.

        Args:
            ids: a 1-D sequence of token ids (list, numpy or jax array).
            skip_special_tokens: drop control tokens such as BOS/EOS from the text.

        Raises:
            ValueError: `ids` is not 1-D or holds an id outside `[0, vocab_size)`.
        """
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if arr.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ids {bad[:8].tolist()} are outside [0, {self.vocab_size})")
        return self.backend.decode(arr.tolist(), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry given in its stored form (e.g. "Ġthe"), or None."""
        return self.backend.token_to_id(token)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Builds the tokenizer stored in a GGUF file's key/value metadata.

        Args:
            meta: GGUF metadata as plain Python values (strings, ints, lists), e.g. from
                `kvjax.models.gguf_loader.read_metadata`.

        Raises:
            UnsupportedModelError: a tokenizer model or pre-tokenizer this class cannot build.
            ValueError: required `tokenizer.ggml.*` keys are missing or inconsistent.
        """
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"tokenizer.ggml.model={model!r} is not supported; supported: 'gpt2' (byte-level "
                "BPE), 'llama' (SentencePiece BPE)"
            )
        if model == "llama":
            return cls._from_sentencepiece_metadata(meta)
        missing = [k for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if k not in meta]
        if missing:
            raise ValueError(f"GGUF metadata lacks {missing}")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)  # a repeated string keeps its first id, as llama.cpp does
        merges = []
        for m in meta["tokenizer.ggml.merges"]:
            left, sep, right = m.partition(" ")  # byte-level symbols never contain a space
            if not sep:
                raise ValueError(f"malformed BPE merge {m!r} (expected 'left right')")
            merges.append((left, right))
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, ...) are special: skipped by decode(skip_special=True).
        # User-defined ones are plain text that must still match as a whole.
        _add_control_and_user_tokens(backend, tokens, types)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            bos_id=None if bos is None else int(bos),
            eos_ids=_gguf_eos_ids(meta),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_default=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def _from_sentencepiece_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """SentencePiece BPE (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE.

        SentencePiece merges, anywhere in the text, the adjacent pair whose union is the
        best-ranked piece. That is BPE with one merge per way of cutting each piece in two,
        ranked by the piece: here by its vocabulary index, which for Gemma follows the score
        order of normal pieces and puts its whitespace-run pieces first (transformers ranks them
        the same way). Runs of spaces are stored as real spaces but text is matched after
        " " -> "▁", so they are respelled. Control tokens become special tokens, other
        user-defined ones (e.g. "\n\n", HTML tags) are matched whole; `<0xXX>` pieces catch
        bytes no piece covers. llama.cpp adds a leading space only when
        `tokenizer.ggml.add_space_prefix` says so (Gemma: no).
        """
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF metadata lacks ['tokenizer.ggml.tokens']")
        raw: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(raw))
        if len(types) != len(raw):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(raw)} tokens"
            )
        spaces = [bool(t) and set(t) == {" "} for t in raw]
        tokens = ["\u2581" * len(t) if sp else t for t, sp in zip(raw, spaces)]
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        merges = []
        for i, t in enumerate(tokens):
            if vocab[t] != i or types[i] not in (_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_USER_DEFINED):
                continue
            if types[i] == _TOKEN_TYPE_USER_DEFINED and not spaces[i]:
                continue  # matched whole as an added token, never built from parts
            merges += [
                (t[:j], t[j:]) for j in range(1, len(t)) if t[:j] in vocab and t[j:] in vocab
            ]
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        backend = tokenizers.Tokenizer(
            models.BPE(
                vocab,
                merges,
                unk_token=None if unk is None else tokens[int(unk)],
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        norm = [normalizers.Replace(" ", "\u2581")]
        if meta.get("tokenizer.ggml.add_space_prefix", False):
            norm.insert(0, normalizers.Prepend("\u2581"))
        backend.normalizer = normalizers.Sequence(norm)
        backend.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix") else [])
        )
        _add_control_and_user_tokens(backend, raw, types, skip_user=spaces)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            bos_id=None if bos is None else int(bos),
            eos_ids=_gguf_eos_ids(meta),
            chat_template=meta.get("tokenizer.chat_template"),
            # llama.cpp prepends BOS to a SentencePiece vocabulary unless told otherwise.
            add_bos_default=bool(meta.get("tokenizer.ggml.add_bos_token", bos is not None)),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Reads only the tokenizer of a GGUF file (the weights are not dequantized)."""
        from kvjax.models.gguf_loader import (
            read_metadata,  # deferred: gguf_loader imports this module
        )

        return cls.from_gguf_metadata(read_metadata(path))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads `tokenizer.json` (+ special-token ids) from a local HuggingFace directory.

        BOS/EOS come from `tokenizer_config.json` (`bos_token`/`eos_token`), with the model's
        `generation_config.json`/`config.json` `eos_token_id` lists added to `eos_ids` and
        `bos_token_id` used when the tokenizer config does not name a BOS token. The chat
        template is read from `chat_template.jinja` or `tokenizer_config.json`.

        Raises:
            ValueError: `path` is not a directory holding `tokenizer.json`.
        """
        d = pathlib.Path(path).expanduser()
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{str(d)!r} has no tokenizer.json (expected a HuggingFace model dir)")
        backend = tokenizers.Tokenizer.from_file(str(tj))
        tok_cfg = _read_json(d / "tokenizer_config.json")
        model_cfg = _read_json(d / "config.json")
        gen_cfg = _read_json(d / "generation_config.json")

        def token_id(entry: Any) -> int | None:
            content = entry.get("content") if isinstance(entry, dict) else entry
            if content is None:
                return None
            i = backend.token_to_id(content)
            if i is None:
                raise ValueError(f"special token {content!r} from {d} is not in the vocabulary")
            return i

        if "bos_token" in tok_cfg:
            bos = token_id(tok_cfg["bos_token"])
        else:
            bos = model_cfg.get("bos_token_id")
        eos: list[int] = []
        for cfg in (gen_cfg, model_cfg):
            e = cfg.get("eos_token_id")
            eos += e if isinstance(e, list) else [] if e is None else [e]
        if (e := token_id(tok_cfg.get("eos_token"))) is not None:
            eos.append(e)
        template: str | None = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            t = tok_cfg.get("chat_template")
            if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}]
                t = next((x["template"] for x in t if x.get("name") == "default"), None)
            template = t
        add_bos = tok_cfg.get("add_bos_token") is True and bos is not None
        return cls(
            backend, bos_id=bos, eos_ids=eos, chat_template=template, add_bos_default=add_bos
        )

    def save_hf_dir(self, path: str | os.PathLike[str]) -> None:
        """Writes `tokenizer.json` + `tokenizer_config.json` that `from_hf_dir` reads back."""
        d = pathlib.Path(path).expanduser()
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        cfg: dict[str, Any] = {
            "bos_token": None if self.bos_id is None else self.backend.id_to_token(self.bos_id),
            "eos_token": self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None,
        }
        if self.add_bos_default:
            cfg["add_bos_token"] = True
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        if len(self.eos_ids) > 1:  # the only HF place that holds several EOS ids
            (d / "generation_config.json").write_text(
                json.dumps({"eos_token_id": list(self.eos_ids)}, indent=2), encoding="utf-8"
            )


def _gguf_eos_ids(meta: Mapping[str, Any]) -> list[int]:
    """EOS, end-of-turn and end-of-message ids a GGUF names, in that order."""
    keys = (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    )
    return [int(meta[k]) for k in keys if meta.get(k) is not None]


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
