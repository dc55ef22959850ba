"""The prompt argument and the one text rule: text as given, or standard input for "-", decoded
strictly."""

from __future__ import annotations

import io

import pytest

from fleettui.commands.prompt import read_prompt
from fleettui.errors import FleetError
from fleettui.text_input import TextError, check_text, decode


class Stdin(io.BytesIO):
    """Bytes on standard input, as the real `sys.stdin.buffer` gives them."""

    def isatty(self) -> bool:
        return False


def test_dash_reads_stdin_and_other_values_are_the_prompt() -> None:
    assert read_prompt("-", Stdin(b"line one\nline two\n")) == "line one\nline two"
    assert read_prompt("-", io.StringIO("line one\nline two\n")) == "line one\nline two"
    assert read_prompt("what is -?", Stdin(b"unused")) == "what is -?"
    with pytest.raises(FleetError, match="empty"):
        read_prompt("-", Stdin(b"  \n"))


def test_invalid_utf8_on_stdin_names_the_source_and_the_byte_offset() -> None:
    with pytest.raises(TextError) as caught:
        read_prompt("-", Stdin(b"caf\xe9 \xff\xfe"))
    assert str(caught.value).startswith("stdin: not valid UTF-8: byte 0xe9 at byte offset 3")
    assert "--encoding" in str(caught.value)
    assert caught.value.offset == 3


def test_an_explicit_encoding_decodes_what_utf8_refuses() -> None:
    assert read_prompt("-", Stdin(b"caf\xe9 \xff\xfe"), encoding="latin-1") == "café ÿþ"
    with pytest.raises(FleetError, match="unknown encoding 'klingon'"):
        read_prompt("-", Stdin(b"x"), encoding="klingon")


def test_bom_crlf_and_nul_follow_the_documented_rule() -> None:
    assert decode("\ufeffhello\r\nworld\rend".encode(), "stdin") == "hello\nworld\nend"
    # one BOM is an encoding mark; a second is text
    assert decode("\ufeff\ufeffx".encode(), "stdin") == "\ufeffx"
    assert decode(b"a\x00b", "stdin") == "a\x00b"  # NUL is a character of a prompt like any other
    with pytest.raises(TextError, match="NUL character at character 1"):
        check_text("a\x00b", "hosts[0].name", allow_nul=False)
    # no line limit: the context length is the limit
    assert decode(b"x" * 1_000_000, "stdin") == "x" * 1_000_000


def test_argv_bytes_and_json_surrogates_are_refused_where_they_are() -> None:
    # how Python hands an undecodable argv byte over
    argv = b"caf\xe9".decode("utf-8", "surrogateescape")
    with pytest.raises(TextError, match=r"^--system: not valid UTF-8: byte 0xe9 at byte offset 3$"):
        check_text(argv, "--system")
    with pytest.raises(TextError, match=r"lone surrogate U\+D800 at character 2"):
        check_text("ab\ud800", "messages[0].content", escapes=False)
    with pytest.raises(TextError, match=r"lone surrogate U\+DCE9 at character 0"):
        check_text("\udce9", "prompt", escapes=False)
    assert check_text("emoji \U0001f600 ok", "prompt") == "emoji \U0001f600 ok"
