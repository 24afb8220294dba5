"""Incremental detokenisation: a character split across tokens is held back until complete, and flushed (as
U+FFFD, like the whole output's decode) when the request ends mid-character."""
from types import SimpleNamespace

from dspark.engine.detok import update_text

# byte-level toy vocabulary: "日" is three tokens (UTF-8 e6 97 a5), as a byte-level BPE can split it
BYTES = {1: b"a", 2: b"\xe6", 3: b"\x97", 4: b"\xa5", 5: b"b"}


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def stream(ids, chunks, stop_strings=()):
    req, tok, pieces = SimpleNamespace(output=[], text="", stop_strings=stop_strings), ByteTokenizer(), []
    for n in chunks:
        req.output.extend(ids[:n])
        ids = ids[n:]
        piece, hit = update_text(req, tok, n)
        pieces.append(piece)
        if hit:
            return req, pieces, hit
    return req, pieces, False


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
