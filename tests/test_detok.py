"""Incremental detokenisation: a character split across tokens is held back until complete, and flushed (as
U+FFFD, like the whole output's decode) when the request ends mid-character; the windowed decode streams
exactly the whole output's decode (checked against a slow reference that decodes everything every step)."""
import random
from types import SimpleNamespace

import pytest

from dspark.engine.detok import update_text

# byte-level toy vocabulary: "日" is three tokens (UTF-8 e6 97 a5), as a byte-level BPE can split it
BYTES = {1: b"a", 2: b"\xe6", 3: b"\x97", 4: b"\xa5", 5: b"b"}


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def new_request(stop_strings=(), min_tokens=0):
    return SimpleNamespace(output=[], text="", text_tokens=0, text_window=0, stop_strings=stop_strings,
                           params=SimpleNamespace(min_tokens=min_tokens))


def stream(ids, chunks, stop_strings=(), tok=None, final_at_end=False):
    req, tok, pieces = new_request(stop_strings), tok or ByteTokenizer(), []
    for i, n in enumerate(chunks):
        req.output.extend(ids[:n])
        ids = ids[n:]
        piece, hit = update_text(req, tok, n, final=final_at_end and i == len(chunks) - 1)
        pieces.append(piece)
        if hit:
            return req, pieces, hit
    return req, pieces, False


def reference_stream(ids, chunks, stop_strings, tok, final_at_end):
    """The slow reference: decode the whole output every step; -> (pieces, text, tokens kept, stop hit)."""
    out, text, pieces = [], "", []
    for i, n in enumerate(chunks):
        first_new = len(out)
        out.extend(ids[:n])
        ids = ids[n:]
        full = tok.decode(out, skip_special_tokens=True)
        hits = [(full.find(s), s) for s in stop_strings]  # one found in streamed text would have ended it then
        hits = sorted((p, s) for p, s in hits if p >= 0)
        if hits:
            pos, stop = hits[0]
            keep = next(k for k in range(max(first_new, 1), len(out) + 1)
                        if tok.decode(out[:k], skip_special_tokens=True).startswith(full[:pos + len(stop)]))
            pieces.append(full[len(text):pos] if pos > len(text) else "")
            return pieces, full[:pos], out[:keep], True
        if full.endswith("\ufffd") and not (final_at_end and i == len(chunks) - 1):
            pieces.append("")
            continue
        pieces.append(full[len(text):])
        text = full
    return pieces, text, out, False


def test_split_character_is_held_back_until_its_last_byte():
    req, pieces, _ = stream([1, 2, 3, 4, 5], [1, 1, 1, 1, 1])
    assert pieces == ["a", "", "", "日", "b"] and req.text == "a日b"


def test_output_ending_mid_character_is_flushed_like_its_decode():
    req, pieces, _ = stream([1, 2, 3], [2, 1])
    assert pieces == ["", ""] and req.text == ""  # "a" is held back with the first bytes of "日"
    tail, _ = update_text(req, ByteTokenizer(), 0, final=True)  # the request ends here
    assert "".join(pieces) + tail == ByteTokenizer().decode([1, 2, 3]) == req.text
    assert tail.startswith("a") and tail.endswith("\ufffd")
    assert update_text(req, ByteTokenizer(), 0, final=True) == ("", False)  # nothing twice


def test_stop_string_across_a_split_character():
    req, pieces, hit = stream([1, 2, 3, 4, 5], [2, 2, 1], stop_strings=("日",))
    assert hit and req.text == "a" and req.output == [1, 2, 3, 4]  # cut to the fewest tokens holding the stop


def test_windowed_decode_matches_the_whole_decode_on_random_byte_streams():
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(list(BYTES)) for _ in range(rng.randint(1, 40))]
        chunks = chunking(rng, len(ids))
        stops = rng.choice([(), ("日",), ("ab",), ("b日a", "aa")])
        final = rng.random() < 0.5
        req, pieces, hit = stream(ids, chunks, stops, final_at_end=final)
        assert (pieces, req.text, req.output, hit) == reference_stream(ids, chunks, stops, ByteTokenizer(), final)


class SentencePieceLikeTokenizer:
    """Decodes as SentencePiece and clean-up decoders do: "▁" is a space, a decode's leading space is dropped, and
    " ." / " ," lose their space, so a window's text depends on where the window starts."""
    PIECES = {1: "a", 2: "▁b", 3: ".", 4: "▁", 5: ",", 6: "▁.", 7: "c"}

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.PIECES[i] for i in ids).replace("▁", " ")
        return text.removeprefix(" ").replace(" .", ".").replace(" ,", ",")


def test_windowed_decode_matches_the_whole_decode_when_decode_rewrites_spaces():
    rng, tok = random.Random(1), SentencePieceLikeTokenizer()
    for _ in range(500):
        ids = [rng.choice(list(tok.PIECES)) for _ in range(rng.randint(1, 30))]
        chunks = chunking(rng, len(ids))
        stops = rng.choice([(), ("b.",), ("a b",), (",c", "bb")])
        req, pieces, hit = stream(ids, chunks, stops, tok=tok)
        # What was streamed is the text, whatever the decode; a stop string may have begun in streamed text (the
        # server holds the last len(stop) - 1 characters back for that: serving/generation.py).
        assert "".join(pieces) == req.text or hit and "".join(pieces).startswith(req.text)
        if prefix_stable(tok, ids):  # then the whole decode streams consistently too, and the window equals it
            assert (pieces, req.text, req.output, hit) == reference_stream(ids, chunks, stops, tok, False)


def prefix_stable(tok, ids) -> bool:
    """Does every prefix's text extend the one before? (" ." after a streamed " " rewrites streamed text: no
    streaming can be exact then, and the whole-decode reference itself drops characters.)"""
    texts = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    return all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def chunking(rng, n):
    chunks = []
    while sum(chunks) < n:
        chunks.append(min(rng.randint(1, 8), n - sum(chunks)))  # up to γ + 1 tokens a step, as the engine emits
    return chunks


@pytest.mark.parametrize("seed", range(3))
def test_windowed_decode_matches_the_whole_decode_with_the_smollm2_tokenizer(smollm2, seed):
    """Real BPE merges, split emoji / CJK / accented characters, special tokens (skipped), random ids."""
    tok, rng = smollm2.tokenizer, random.Random(seed)
    text = "Naïve café — 日本語のテキスト 🙂🚀 x² ≤ π; def f(a):\n    return a  # ok\n\n¿Qué tal? Ünïcödé"
    encoded = tok.encode(text, add_special_tokens=False)
    for trial in range(40):
        ids = list(encoded) if trial % 2 == 0 else [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
        if trial % 4 == 1:
            ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)  # a special token, skipped by decode
        chunks = chunking(rng, len(ids))
        stops = rng.choice([(), ("日本",), ("\n\n", "🚀"), ("return a",), (" é",)])
        final = rng.random() < 0.5
        req, pieces, hit = stream(ids, chunks, stops, tok=tok, final_at_end=final)
        assert (pieces, req.text, req.output, hit) == reference_stream(ids, chunks, stops, tok, final)
        if not hit and final:
            assert "".join(pieces) == req.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_strings_are_not_matched_before_min_tokens():
    """'b' at token 2 is ignored (2 < min_tokens = 4); the 'b' at token 6 stops the request, cut after it."""
    req, tok = new_request(("b",), min_tokens=4), ByteTokenizer()
    hits = []
    for t in [1, 5, 1, 1, 1, 5, 1]:
        req.output.append(t)
        piece, hit = update_text(req, tok, 1)
        hits.append(hit)
        if hit:
            break
    assert hits == [False, False, False, False, False, True]
    assert req.text == "abaaa" and req.output == [1, 5, 1, 1, 1, 5]


def test_a_block_crossing_min_tokens_matches_only_stops_ending_from_token_min_tokens():
    """Tokens 1-6 arrive in one block with min_tokens = 4: the 'b' in token 2 does not stop the request, the one in
    token 5 does (as if each token had been checked on its own)."""
    req = new_request(("b",), min_tokens=4)
    req.output.extend([1, 5, 1, 1, 5, 1])
    piece, hit = update_text(req, ByteTokenizer(), 6)
    assert hit and req.text == piece == "abaa" and req.output == [1, 5, 1, 1, 5]
