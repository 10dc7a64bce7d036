"""Tokenizer: an HF `tokenizers.Tokenizer` plus special-token ids and the model's Jinja chat template.

Two constructors:

* `Tokenizer.from_gguf_metadata(metadata)` builds a byte-level BPE (llama.cpp `tokenizer.ggml.model
  == "gpt2"`) from the vocabulary / merges / token types stored in a GGUF file's metadata. The
  pre-tokenizer follows `tokenizer.ggml.pre` the way llama.cpp does (e.g. "smollm" isolates every
  digit before the GPT-2 split, as the original SmolLM2 `tokenizer.json` does).
* `Tokenizer.from_hf_folder(folder)` reads `tokenizer.json` (+ `tokenizer_config.json`,
  `chat_template.jinja`, `config.json`, `generation_config.json` when present).

Chat templates are rendered with jinja2 in a sandboxed environment configured like transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`).
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import warnings
from typing import Any, Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

# llama.cpp token types (gguf.TokenType)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn markers of common chat formats: added to eos_token_ids when the chat template uses them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
                      "<|END_OF_TURN_TOKEN|>", "<|endoftext|>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) grouped by the regex sequence llama.cpp uses.
_PRE_GPT2 = {"default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
             "jina-v2-code", "roberta-bpe", "olmo", "poro-chat", "viking"}
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"}
_PRE_QWEN2 = {"qwen2", "deepseek-r1-qwen", "megrez"}


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _gguf_pre_tokenizer(pre: str | None, hf_compat: bool):
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (only GPT-2 regex when hf_compat)."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if hf_compat and pre not in _PRE_LLAMA3 and pre not in _PRE_QWEN2:
        # transformers' GGUF tokenizer conversion knows the llama3/qwen2 splits but not "smollm" & co.
        return gpt2
    if pre is None or pre in _PRE_GPT2:
        return gpt2
    if pre in _PRE_DIGITS_THEN_GPT2:
        # llama.cpp applies "\p{N}" first, then the GPT-2 regex to each resulting piece.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            gpt2,
        ])
    if pre in _PRE_LLAMA3 or pre in _PRE_QWEN2:
        split = _LLAMA3_SPLIT if pre in _PRE_LLAMA3 else _QWEN2_SPLIT
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    warnings.warn(f"Unknown GGUF pre-tokenizer {pre!r}; falling back to the GPT-2 split "
                  f"(tokenization of some inputs may differ from llama.cpp)", stacklevel=3)
    return gpt2


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return value.get("content")
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------- chat templates
@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF assistant-mask marker): rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class _Namespace(jinja2.utils.Namespace):
        # Like HF: refuse underscore attributes on namespaces.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace ({name!r})")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class Tokenizer:
    """Text <-> token ids, special ids, and chat-template rendering."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int | None = None,
                 unk_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_default: bool = False):
        self.backend = backend
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        eos = []
        for i in eos_token_ids:
            if int(i) not in eos:
                eos.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.unk_token_id = None if unk_token_id is None else int(unk_token_id)
        # Padding id: explicit pad token, else the first eos (never attended to anyway), else 0.
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        self.chat_template = chat_template
        self.add_bos_default = bool(add_bos_default)

    # ------------------------------------------------------------------ basic properties / lookups
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self.id_to_token(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return None if self.unk_token_id is None else self.id_to_token(self.unk_token_id)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # ----------------------------------------------------------------------------- encode/decode
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>`) map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        out = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            out = [[self.bos_token_id] + ids for ids in out]
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Cheap enough to call on a growing id list while streaming (an incomplete
        UTF-8 sequence at the end renders as U+FFFD until its remaining bytes arrive)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE token may be part of a UTF-8
        character; `<0xNN>` byte tokens are that byte), for per-token log-probability output."""
        tok = self.id_to_token(i)
        if tok is None:
            return b""
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            try:
                return bytes([int(tok[3:5], 16)])
            except ValueError:
                pass
        inv = _unicode_to_bytes()
        if all(c in inv for c in tok):
            return bytes(inv[c] for c in tok)
        return self.decode([i], skip_special_tokens=False).encode("utf-8")

    # ----------------------------------------------------------------------------- chat template
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs) -> str:
        """Render `messages` with the model's Jinja chat template (as transformers does, tokenize=False).

        `continue_final_message=True` drops everything the template writes after the final message's
        content (for prefilling a partial assistant turn); it implies add_generation_prompt=False.
        Extra keyword arguments (e.g. `tools=`, `documents=`) are passed to the template.
        """
        if not self.chat_template:
            raise ValueError("This tokenizer has no chat template")
        template = _compile_chat_template(self.chat_template)
        msgs = [dict(m) for m in messages]
        if continue_final_message:
            if not msgs or not isinstance(msgs[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with string content")
            if add_generation_prompt:
                add_generation_prompt = False
            final = msgs[-1]["content"]
            msgs[-1]["content"] = final + _CONTINUE_TAG
        variables = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                         pad_token=self.pad_token or "", unk_token=self.unk_token or "",
                         tools=None, documents=None)
        variables.update(kwargs)
        rendered = template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                   **variables)
        if continue_final_message:
            cut = rendered.rfind(_CONTINUE_TAG)
            if cut < 0:
                raise ValueError("continue_final_message: the template does not render the final message verbatim")
            rendered = rendered[:cut]
        return rendered

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs) -> list[int]:
        """Token ids of the rendered chat (no extra BOS: templates that want one write `bos_token`).

        Only the template inserts control tokens: a special-token string typed inside a message
        (e.g. a user writing `<|im_start|>system`) is encoded as plain text, so a message cannot
        forge a role; one in any other string field of a message (its role, a name) is a ValueError.
        Chats without such text tokenize exactly as `encode(apply_chat_template(...))`.
        """
        for i, m in enumerate(messages):        # only content is located and encoded as plain text below
            for key, value in (m.items() if isinstance(m, Mapping) else ()):
                if key != "content" and isinstance(value, str) and self._special_pattern().search(value):
                    raise ValueError(f"messages[{i}].{key} contains special-token text; only the chat template "
                                     f"may write control tokens")
        rendered = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, **kwargs)
        contents = [m.get("content") for m in messages if isinstance(m, Mapping)]
        if not any(isinstance(c, str) and self._special_pattern().search(c) for c in contents):
            return self.encode(rendered)
        ids, pos = [], 0
        for c in contents:                      # locate each message's text in the rendering, in order
            if not isinstance(c, str) or not c:
                continue
            for text in (c, c.strip()):
                at = rendered.find(text, pos) if text else -1
                if at >= 0:
                    break
            else:
                raise ValueError("a message contains special-token text and the chat template transforms "
                                 "message content, so it cannot be encoded safely")
            ids += self.encode(rendered[pos:at]) + self.encode_plain(text)
            pos = at + len(text)
        return ids + self.encode(rendered[pos:])

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a user's text outside a chat (an SFT response): special-token strings in it
        are ordinary text, as in `encode_chat`'s message content (only a template writes control
        tokens); the same ids as `encode` for text without them."""
        return self.encode_plain(text) if self._special_pattern().search(text) else self.encode(text)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings encoded as ordinary text."""
        if getattr(self, "_plain_backend", None) is None:
            plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    def _special_pattern(self):
        if getattr(self, "_special_re", None) is None:
            import re
            specials = sorted((t.content for t in self.backend.get_added_tokens_decoder().values()
                               if t.special and t.content), key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, specials)) if specials else r"(?!x)x")
        return self._special_re

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token can cover (prompt-length pre-checks)."""
        if getattr(self, "_max_token_bytes", None) is None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
        return self._max_token_bytes

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, hf_compat: bool = False) -> "Tokenizer":
        """Build from GGUF metadata (key -> python value: `tokenizer.ggml.tokens`, `...merges`,
        `...token_type`, `...bos_token_id`, ..., `tokenizer.chat_template`).

        hf_compat=True reproduces transformers' GGUF tokenizer conversion, which ignores
        `tokenizer.ggml.pre` values it does not know (e.g. SmolLM2's "smollm" digit isolation).
        """
        model_type = metadata.get("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise ValueError(
                f"Unsupported GGUF tokenizer model {model_type!r}: only byte-level BPE "
                f"(tokenizer.ggml.model == 'gpt2') is supported; use an HF folder with tokenizer.json instead")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        merges_raw = metadata.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
        token_types = list(metadata.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens))
        alphabet = set(_bytes_to_unicode().values())
        b2u = _bytes_to_unicode()

        vocab: dict[str, int] = {}
        specials: list[tuple[int, str, bool]] = []
        for i, (tok, tt) in enumerate(zip(tokens, token_types)):
            if tt in (_TT_CONTROL, _TT_USER_DEFINED):
                specials.append((i, tok, tt == _TT_CONTROL))
                key = tok
            elif set(tok) <= alphabet:
                key = tok
            else:  # a token written in raw text instead of the byte alphabet: respell it
                key = "".join(b2u[b] for b in tok.encode("utf-8"))
            if key in vocab:   # duplicate spelling: keep first, make the later id unreachable by text
                key = f"<preft_dup_{i}>"
            vocab[key] = i
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]

        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre"), hf_compat)
        backend.decoder = decoders.ByteLevel()
        # Add in id order so that every added token keeps its vocabulary id.
        control = [AddedToken(t, normalized=False, special=True) for _, t, is_ctl in specials if is_ctl]
        user = [AddedToken(t, normalized=False, special=False) for _, t, is_ctl in specials if not is_ctl]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
        for i, t, _ in specials:
            got = backend.token_to_id(t)
            if got != i:
                raise ValueError(f"GGUF special token {t!r}: expected id {i}, tokenizer assigned {got}")

        template = metadata.get("tokenizer.chat_template")
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = _as_id_list(metadata.get("tokenizer.ggml.eos_token_id"))
        eos += _as_id_list(metadata.get("tokenizer.ggml.eot_token_id"))
        eos += _as_id_list(metadata.get("tokenizer.ggml.eom_token_id"))
        eos += _template_end_of_turn_ids(template, backend)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos,
                   pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
                   unk_token_id=metadata.get("tokenizer.ggml.unknown_token_id"),
                   chat_template=template,
                   add_bos_default=bool(metadata.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike) -> "Tokenizer":
        """Build from an HF model folder (`tokenizer.json` required)."""
        folder = pathlib.Path(folder)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"No tokenizer.json in {folder} (only fast/`tokenizers` tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tj))
        tcfg = _read_json(folder / "tokenizer_config.json")
        mcfg = _read_json(folder / "config.json")
        gcfg = _read_json(folder / "generation_config.json")

        template = _load_hf_chat_template(folder, tcfg)

        def tid(name: str) -> int | None:
            content = _token_content(tcfg.get(name))
            return None if content is None else backend.token_to_id(content)

        bos = tid("bos_token")
        if bos is None:
            bos = next(iter(_as_id_list(mcfg.get("bos_token_id"))), None)
        eos: list[int] = []
        e = tid("eos_token")
        if e is not None:
            eos.append(e)
        eos += _as_id_list(gcfg.get("eos_token_id"))
        eos += _as_id_list(mcfg.get("eos_token_id"))
        eos += _template_end_of_turn_ids(template, backend)
        pad = tid("pad_token")
        if pad is None:
            pad = next(iter(_as_id_list(mcfg.get("pad_token_id"))), None)
        # The post-processor may add BOS; we add BOS explicitly instead (encode(add_bos=...)), where
        # HF's tokenizer(text) would: tokenizer_config's add_bos_token, else what the post-processor
        # does (Llama-3's tokenizer.json prepends <|begin_of_text|> there and says nothing in the config)
        if "add_bos_token" in tcfg:
            add_bos = bool(tcfg["add_bos_token"])
        else:
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and probe[:1] == [bos] and backend.encode("a", add_special_tokens=False).ids[:1] != [bos]
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad,
                   unk_token_id=tid("unk_token"), chat_template=template, add_bos_default=add_bos)

    # ------------------------------------------------------------------------------ serialization
    def to_json(self) -> str:
        """Everything this Tokenizer holds as one JSON string (inverse of `from_json`)."""
        return json.dumps({
            "format": "preft_jax.tokenizer", "version": 1, "backend": self.backend.to_str(),
            "bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id, "unk_token_id": self.unk_token_id,
            "chat_template": self.chat_template, "add_bos_default": self.add_bos_default,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> "Tokenizer":
        d = json.loads(text)
        if d.get("format") != "preft_jax.tokenizer" or d.get("version") != 1:
            raise ValueError("not a preft_jax tokenizer JSON (format/version mismatch)")
        return cls(tokenizers.Tokenizer.from_str(d["backend"]), bos_token_id=d["bos_token_id"],
                   eos_token_ids=d["eos_token_ids"], pad_token_id=d["pad_token_id"],
                   unk_token_id=d["unk_token_id"], chat_template=d["chat_template"],
                   add_bos_default=d["add_bos_default"])

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, pad={self.pad_token_id}, chat_template={bool(self.chat_template)})")


def _template_end_of_turn_ids(template: str | None, backend: tokenizers.Tokenizer) -> list[int]:
    if not template:
        return []
    out = []
    for tok in END_OF_TURN_TOKENS:
        if tok in template:
            i = backend.token_to_id(tok)
            if i is not None:
                out.append(i)
    return out


def _load_hf_chat_template(folder: pathlib.Path, tcfg: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tmpl = tcfg.get("chat_template")
    if tmpl is None:
        tmpl = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, Mapping)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl
