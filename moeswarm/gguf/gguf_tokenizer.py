"""A `tokenizers` tokenizer (and chat template) from GGUF metadata: text in and out, no other file.

BPE vocabularies (`tokenizer.ggml.model = gpt2`) are byte-level: tokens are GPT-2's printable
byte strings and `tokenizer.ggml.merges` the merge list. `tokenizer.ggml.pre` names llama.cpp's
pre-tokenizer (how text is split before BPE); the known ones map to their split regex below.
Control and user-defined tokens become special tokens, matched whole and never split.

The lists are checked before the tokenizer is built (gguf_bounds.py checked their types and
lengths): every merge is two tokens of the vocabulary whose join is one too, as `tokenizers`'
BPE requires; what `tokenizers` still refuses ends in the same one-line ModelError.
"""

from __future__ import annotations

from moeswarm.errors import ModelError
from moeswarm.gguf.gguf_file import GGUFFile

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
PRE_TOKENIZER_REGEX: dict[str, str] = {
    "default": _GPT2, "gpt-2": _GPT2, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3, "smaug-bpe": _LLAMA3, "kimi-k2": _LLAMA3, "gpt-4o": _LLAMA3,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def gguf_tokenizer(f: GGUFFile):
    """A transformers fast tokenizer built from the file's tokenizer.ggml.* metadata."""
    meta = f.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"{f.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEX:
        raise ModelError(f"{f.path}: pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZER_REGEX))}")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _merges(f, meta.get("tokenizer.ggml.merges", []), vocab)
    try:
        return _build(f, tokens, vocab, merges, pre)
    except ModelError:
        raise
    except Exception as error:  # tokenizers' own refusals (a Rust error as Exception): one line
        raise ModelError(f"{f.path}: tokenizer.ggml.*: cannot build the BPE tokenizer ({error})") from None


def _merges(f: GGUFFile, merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merge list as pairs, each of two vocabulary tokens whose join is in the vocabulary."""
    pairs = []
    for index, merge in enumerate(merges):
        pair = tuple(merge.split(" "))
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise ModelError(f"{f.path}: tokenizer.ggml.merges[{index}] {merge[:40]!r} is not two vocabulary tokens "
                             "whose join is one")
        pairs.append(pair)
    return pairs


def _build(f: GGUFFile, tokens: list[str], vocab: dict[str, int], merges: list[tuple[str, str]], pre: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    meta = f.metadata
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tokenizer.add_special_tokens(special)

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=token("bos_token_id"),
                                      eos_token=token("eos_token_id"), pad_token=token("padding_token_id"))
    if (template := meta.get("tokenizer.chat_template")) is not None:
        wrapped.chat_template = template
    return wrapped
