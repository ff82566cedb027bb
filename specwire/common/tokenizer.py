"""Text <-> token ids for a model: the model's BOS rule, its chat template, streaming decode.

`Tokenizer` wraps a Hugging Face fast tokenizer (a `tokenizers.Tokenizer` underneath). It is built
from a model folder's `tokenizer.json` or from the vocabulary a GGUF file carries; both give the
same ids, and `fingerprint` says so in one string (the drafter and target compare fingerprints
before they agree to speculate together).
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as CoreTokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast


class Tokenizer:
    """A model's tokenizer. Picklable (the transformers tokenizer underneath is)."""

    def __init__(self, hf: PreTrainedTokenizerFast):
        self._hf = hf
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        # Whether the model wants BOS in front of a prompt. Asked of the tokenizer itself rather
        # than read from a flag: folders say it in the post-processor, GGUF files in metadata,
        # and transformers folds both into what `__call__` adds.
        probe = hf("a", add_special_tokens=True)["input_ids"]
        self.add_bos: bool = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """From a Hugging Face model folder (tokenizer.json, tokenizer_config.json, template)."""
        return cls(PreTrainedTokenizerFast.from_pretrained(str(folder)))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """From the vocabulary, merges, special ids and chat template stored in a GGUF file."""
        path = Path(path)
        return cls(PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name))

    @classmethod
    def from_core(
        cls, core: CoreTokenizer, *, bos_token: str, eos_token: str, chat_template: str | None
    ) -> Tokenizer:
        """From a `tokenizers.Tokenizer` built in code (the tiny-random model's)."""
        hf = PreTrainedTokenizerFast(
            tokenizer_object=core,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=chat_template,
        )
        return cls(hf)

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and the chat template into `folder`."""
        self._hf.save_pretrained(str(folder))

    @property
    def core(self) -> CoreTokenizer:
        """The `tokenizers.Tokenizer` doing the work."""
        return self._hf.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (the model's embedding may have more rows)."""
        return self.core.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._hf.chat_template

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS in front iff the model wants it. Special-token text
        (e.g. `<|im_start|>`) maps to its special id."""
        ids = self.core.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            assert self.bos_token_id is not None
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.core.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render `messages` with the model's own chat template and tokenize the result.

        Message content is tokenized as plain text: special-token text a user types (e.g.
        `<|im_start|>`) stays text and never becomes a control token. Only the template's own
        text may produce special tokens. (The template is rendered with a marker in place of
        each content; the pieces between markers are the template's.) The template writes any
        BOS it wants itself, so no BOS is added on top (as transformers does it).
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
        placeholders = [{**m, "content": mark} for m, mark in zip(messages, markers, strict=True)]
        text = self._hf.apply_chat_template(
            placeholders, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        ids: list[int] = []
        for m, mark in zip(messages, markers, strict=True):
            head, found, text = text.partition(mark)
            if not found:
                raise ValueError("the chat template does not render message content verbatim")
            ids += self.core.encode(head, add_special_tokens=False).ids if head else []
            ids += self._plain.encode(str(m["content"]), add_special_tokens=False).ids
        if text:
            ids += self.core.encode(text, add_special_tokens=False).ids
        return ids

    @cached_property
    def _plain(self) -> CoreTokenizer:
        """A copy of the tokenizer that treats special-token text as ordinary text."""
        plain = CoreTokenizer.from_str(self.core.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def fingerprint(self) -> str:
        """sha256 hex over the vocabulary (with added tokens) and the merges.

        Equal for two tokenizers that map text to the same ids, however they were stored.
        """
        model = json.loads(self.core.to_str())["model"]
        # Older tokenizers serialize a merge as "a b", newer ones as ["a", "b"].
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges", ())]
        vocab = sorted(self.core.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        blob = json.dumps({"vocab": vocab, "merges": merges}, ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class IncrementalDecoder:
    """Turns a stream of generated token ids into text deltas.

    A character split across tokens (multi-byte UTF-8 in byte-level vocabularies) is held back
    until its last byte arrives, so a delta never ends in half a character. `flush()` returns
    whatever is still held (as U+FFFD if it never completed) at the end of a stream.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._core = tokenizer.core  # looked up once: `core` goes through transformers
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def feed(self, token_id: int) -> str:
        """The text that `token_id` completes ("" while a character is incomplete)."""
        text = self._stream.step(self._core, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        if self._held:
            self._held.clear()
        return text

    def feed_many(self, token_ids: list[int]) -> str:
        if len(token_ids) == 1:  # a plain step's one token: no generator, no join
            return self.feed(token_ids[0])
        return "".join([self.feed(t) for t in token_ids])

    def flush(self) -> str:
        """Text of tokens still held back; the decoder starts afresh afterwards."""
        text = self._tokenizer.decode(self._held, skip_special_tokens=self._skip_special_tokens)
        self._held.clear()
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return text
