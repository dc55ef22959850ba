"""Provides the one rule by which text enters fleettui: bytes are decoded strictly, strings hold no
lone surrogate.

Every source goes through here: standard input, prompt files, command-line strings (`--system`),
fleet-file strings, the TUI's chat input and the HTTP API's JSON bodies. docs/input.md states the
rule for users."""

from __future__ import annotations

import codecs

from fleettui.errors import FleetError

BOM = "\ufeff"
UTF8 = "utf-8"


class TextError(FleetError):
    """Text that is not text: undecodable bytes or a lone surrogate; ``str()`` names the source
    and where."""

    def __init__(self, source: str, reason: str, offset: int) -> None:
        self.source, self.reason, self.offset = source, reason, offset
        super().__init__(f"{source}: {reason}")


def check_encoding(name: str | None) -> str:
    """The codec called `name` (None: UTF-8), or a one-line `FleetError` for one Python does not
    know."""
    if name is None:
        return UTF8
    try:
        return codecs.lookup(name).name
    except LookupError:
        raise FleetError(
            f"--encoding: unknown encoding {name!r} (e.g. utf-8, latin-1, cp1252)"
        ) from None


ENCODING_HINT = "give --encoding if the text is in another encoding (e.g. latin-1)"


def decode(data: bytes, source: str, encoding: str | None = None, hint: str = ENCODING_HINT) -> str:
    """`data` as text: strictly decoded (UTF-8 unless `encoding` names another codec), one leading
    BOM dropped, CRLF and lone CR read as LF (the newline rule of Python's text files); refused with
    the byte offset of the first byte that does not decode."""
    codec = check_encoding(encoding)
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as error:
        bad = data[error.start : error.end]
        shown = f"; {hint}" if hint and encoding is None else ""
        raise TextError(
            source,
            f"not valid {codec.upper() if codec == UTF8 else codec}: byte 0x{bad[:1].hex()} at "
            "byte offset "
            f"{error.start} ({error.reason}){shown}",
            error.start,
        ) from None
    if text.startswith(BOM):
        text = text[1:]
    return check_text(text.replace("\r\n", "\n").replace("\r", "\n"), source)


def check_text(text: str, source: str, *, allow_nul: bool = True, escapes: bool = True) -> str:
    """`text` itself, or a `TextError` for its first lone surrogate (or NUL, when not allowed).

    A string from the command line carries an undecodable byte as a surrogate escape
    (U+DC80..U+DCFF, how Python decodes argv): with `escapes`, that one is reported as the byte at
    its byte offset. Any other lone surrogate (a JSON escape such as "\\ud800") is reported at its
    character index."""
    for index, char in enumerate(text):
        point = ord(char)
        if 0xD800 <= point <= 0xDFFF:
            if (
                escapes and 0xDC80 <= point <= 0xDCFF
            ):  # argv's surrogateescape: the byte it stands for
                offset = len(text[:index].encode(UTF8, "surrogateescape"))
                raise TextError(
                    source,
                    f"not valid UTF-8: byte 0x{point - 0xDC00:02x} at byte offset {offset}",
                    offset,
                )
            raise TextError(
                source, f"a lone surrogate U+{point:04X} at character {index} is not text", index
            )
        if point == 0 and not allow_nul:
            raise TextError(
                source, f"a NUL character at character {index} is not allowed here", index
            )
    return text
