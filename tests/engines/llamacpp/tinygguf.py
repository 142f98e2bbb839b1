"""A tiny llama-architecture GGUF model with random weights, written locally for tests.

The model is real as far as llama.cpp is concerned: a SentencePiece ("llama") vocabulary with
byte fallback, ChatML special tokens and a ChatML chat template, and two transformer blocks of
F32 weights. It generates gibberish, fast, on any CPU; the file is well under a megabyte.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from numpy.typing import NDArray

ARCH = "llama"
SPACE = "\u2581"  # SentencePiece's word-boundary marker
SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK, BOS, EOS, IM_START, IM_END = range(len(SPECIALS))
WORDS = ("the", "and", "capy", "bara", "llama", "model", "token", "hello", "world", "river")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The model's dimensions: small enough to decode hundreds of tokens a second on one core.
N_EMBD, N_FF, N_CTX_TRAIN = 64, 128, 4096
N_LAYER, N_HEAD, N_HEAD_KV = 2, 4, 2
HEAD_DIM = N_EMBD // N_HEAD


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[gguf.TokenType]


def build_vocab() -> Vocab:
    """Specials, the 256 byte-fallback tokens, then printable ASCII pieces and a few words.

    Only bytes that render as printable ASCII (plus tab and newline) are typed BYTE; the others
    are UNUSED, so input in any script still tokenizes (through `<0xNN>`) while generated text
    stays valid ASCII: llama.cpp renders UNUSED tokens as nothing.
    """
    tokens = list(SPECIALS)
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * (len(SPECIALS) - 1)
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        printable = 0x20 <= byte < 0x7F or byte in (0x09, 0x0A)
        types.append(gguf.TokenType.BYTE if printable else gguf.TokenType.UNUSED)
    chars = [c for c in string.printable if c.isprintable() and c != " "]
    pieces = [SPACE, *chars, *(SPACE + c for c in string.ascii_letters)]
    pieces += [SPACE + word for word in WORDS]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SentencePiece merges toward the higher score; longer pieces win.
    scores = [0.0] * (len(SPECIALS) + 256) + [float(len(p)) for p in pieces]
    return Vocab(tokens, scores, types)


def _weights(rng: np.random.Generator, *shape: int) -> NDArray[np.float32]:
    """Random F32 weights; numpy's (rows, cols) becomes GGUF's (cols, rows) as llama.cpp wants."""
    return rng.normal(0.0, 0.5 / np.sqrt(shape[-1]), size=shape).astype(np.float32)


def _write_metadata(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_name("capyctl-tiny-random")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(UNK)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(IM_END)
    writer.add_eot_token_id(IM_END)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _write_tensors(writer: gguf.GGUFWriter, n_vocab: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_embd, n_kv = N_EMBD, N_HEAD_KV * HEAD_DIM
    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", _weights(rng, n_vocab, n_embd))
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones)
        writer.add_tensor(f"{blk}.attn_q.weight", _weights(rng, n_embd, n_embd))
        writer.add_tensor(f"{blk}.attn_k.weight", _weights(rng, n_kv, n_embd))
        writer.add_tensor(f"{blk}.attn_v.weight", _weights(rng, n_kv, n_embd))
        writer.add_tensor(f"{blk}.attn_output.weight", _weights(rng, n_embd, n_embd))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones)
        writer.add_tensor(f"{blk}.ffn_gate.weight", _weights(rng, N_FF, n_embd))
        writer.add_tensor(f"{blk}.ffn_up.weight", _weights(rng, N_FF, n_embd))
        writer.add_tensor(f"{blk}.ffn_down.weight", _weights(rng, n_embd, N_FF))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", _weights(rng, n_vocab, n_embd))


def write_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Write the tiny model to `path` (same seed, same bytes) and return `path`."""
    vocab = build_vocab()
    writer = gguf.GGUFWriter(path, ARCH)
    _write_metadata(writer, vocab)
    _write_tensors(writer, len(vocab.tokens), seed)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
