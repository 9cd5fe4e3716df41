"""Untrusted input handled in one place (engine/shared/untrusted.py): foreign text made visible, files that may not
be files refused before they are read, JSON as JSON defines it, names the file system cannot hold, integers outside
int64 and prompts that are not UTF-8. Each expectation is written out by hand (the escape of a character, the byte
offset of a bad byte), or made by the operating system (a FIFO, a socket, a device)."""
from __future__ import annotations

import os
import re
import socket
import stat

import pytest

from prefill_diff.engine.shared import untrusted
from prefill_diff.engine.shared.errors import ConfigError, PrefillDiffError
from prefill_diff.engine.shared.untrusted import (CONFIG_LIMIT, INT64_MAX, INT64_MIN, check_int64, check_name_length,
                                                  check_prompt_text, name_max, partial_sibling, read_small_file,
                                                  regular_file, strict_json, visible)


# -- visible ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["layer 3 attn_update", "é", "模型 🙂", "[bold red]not markup here[/]",
                                  "a b\u00a0c", "", "family=llama\\x1b"])
def test_printable_text_is_shown_as_it_is(text):
    assert visible(text) == text


@pytest.mark.parametrize("text, shown", [
    ("a\x1b[31mred", "a\\x1b[31mred"),  # ESC: a terminal colour sequence, inert
    ("line\rover", "line\\x0dover"),  # CR would overwrite the line
    ("\x07", "\\x07"),  # BEL
    ("\x7f", "\\x7f"),  # DEL
    ("\x85", "\\x85"),  # C1 next line
    ("\x9b", "\\x9b"),  # C1 CSI
    ("a\nb\tc", "a\\x0ab\\x09c"),  # newline and tab: one line stays one line
    ("\x00", "\\x00"),
])
def test_control_characters_are_escapes(text, shown):
    assert visible(text) == shown


@pytest.mark.parametrize("code", [0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069, 0x200E,
                                  0x200F, 0x061C])
def test_every_bidirectional_override_and_isolate_is_an_escape(code):
    """The twelve characters of "Trojan source" (CVE-2021-42574), each written \\uXXXX."""
    assert visible(f"x{chr(code)}y") == f"x\\u{code:04x}y"


@pytest.mark.parametrize("code", [0xFFFE, 0xFFFF, 0x1FFFE, 0x1FFFF, 0x10FFFE, 0x10FFFF, 0xFDD0, 0xFDEF])
def test_noncharacters_are_escapes(code):
    want = f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    assert visible(chr(code)) == want


@pytest.mark.parametrize("text, shown", [
    ("\ud800", "\\ud800"), ("a\udcffb", "a\\udcffb"),  # lone surrogates (bytes that were not UTF-8)
    ("\u2028", "\\u2028"), ("\u2029", "\\u2029"),  # line and paragraph separators
    ("\ufeffname", "\\ufeffname"),  # a byte order mark inside text
])
def test_surrogates_separators_and_byte_order_marks_are_escapes(text, shown):
    assert visible(text) == shown


def test_characters_next_to_the_escaped_ones_are_kept():
    """The ranges end where they should: U+202F, U+2065, U+206A, U+FDCF and U+FDF0 are not escaped, and printable
    text around an escape is unchanged."""
    kept = "\u202f\u2065\u206a\ufdcf\ufdf0\ufffd"
    assert visible(kept + "\x1b") == kept + "\\x1b"


def test_anything_is_shown_as_its_text():
    assert visible(3) == "3" and visible(None) == "None"
    assert visible(ValueError("bad\x1b")) == "bad\\x1b"


# -- regular_file, read_small_file -------------------------------------------------------------------------------------

def test_a_regular_file_is_returned_as_its_path(tmp_path):
    p = tmp_path / "run.toml"
    p.write_bytes(b"[run]\n")
    assert regular_file(p, "config") == str(p)
    assert regular_file(str(p), "config", limit=6) == str(p)  # exactly at the limit


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(PrefillDiffError, match=re.escape(f"{tmp_path / 'none.toml'}: no such config")):
        regular_file(tmp_path / "none.toml", "config")


def test_a_path_through_a_file_cannot_be_read(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(PrefillDiffError, match=r"cannot read config \(Not a directory\)"):
        regular_file(tmp_path / "f" / "x", "config")


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(PrefillDiffError, match=r"the config is a directory, not a regular file"):
        regular_file(tmp_path, "config")


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it for reading would block: the refusal returns at once
    with pytest.raises(PrefillDiffError, match=r"the config is a FIFO \(named pipe\), not a regular file"):
        regular_file(fifo, "config")
    with pytest.raises(PrefillDiffError, match=r"FIFO"):
        read_small_file(fifo, "config")


def test_a_link_to_a_fifo_names_where_it_leads(tmp_path):
    fifo, link = tmp_path / "pipe", tmp_path / "run.toml"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    with pytest.raises(PrefillDiffError) as e:
        regular_file(link, "config")
    assert str(e.value) == f"{link}: the config is a FIFO (named pipe) (a link to {fifo}), not a regular file"


def test_a_character_device_is_refused():
    assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)
    with pytest.raises(PrefillDiffError, match=r"/dev/zero: the config is a character device, not a regular file"):
        read_small_file("/dev/zero", "config")  # would never end if read


def test_a_socket_is_refused(tmp_path):
    path = tmp_path / "s"
    if len(os.fsencode(str(path))) >= 100:
        pytest.skip("the temporary path is too long for a socket address")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        with pytest.raises(PrefillDiffError, match=r"the config is a socket, not a regular file"):
            regular_file(path, "config")


def test_a_file_over_the_limit_is_refused_by_its_size(tmp_path):
    p = tmp_path / "big.toml"
    p.write_bytes(b"x" * 11)
    with pytest.raises(PrefillDiffError, match=r"the config is 11 bytes, over the 10-byte limit"):
        regular_file(p, "config", limit=10)
    with pytest.raises(PrefillDiffError, match=r"the config is 11 bytes, over the 10-byte limit"):
        read_small_file(p, "config", limit=10)


def test_a_small_file_is_read_whole(tmp_path):
    p = tmp_path / "run.toml"
    p.write_bytes(b"[run]\nmodel = 'tiny'\n\xff")
    assert read_small_file(p, "config") == b"[run]\nmodel = 'tiny'\n\xff"
    assert read_small_file(p, "config", limit=22) == b"[run]\nmodel = 'tiny'\n\xff"
    assert CONFIG_LIMIT == 1 << 20


def test_a_path_swapped_for_a_fifo_after_the_check_is_refused(tmp_path, monkeypatch):
    """The path checked can be replaced before it is opened: the open file is checked again, without blocking."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    monkeypatch.setattr(untrusted, "regular_file", lambda path, what, limit=None: str(path))  # the check passed
    with pytest.raises(PrefillDiffError, match=r"the config is not a regular file"):
        read_small_file(fifo, "config")


def test_a_file_grown_after_the_check_is_not_read_past_the_limit(tmp_path, monkeypatch):
    p = tmp_path / "run.toml"
    p.write_bytes(b"y" * 100)
    monkeypatch.setattr(untrusted, "regular_file", lambda path, what, limit=None: str(path))  # it was small then
    with pytest.raises(PrefillDiffError, match=r"the config is over the 10-byte limit"):
        read_small_file(p, "config", limit=10)


# -- strict_json -------------------------------------------------------------------------------------------------------

def test_json_is_parsed():
    assert strict_json(b'{"a": [1, 2.5, "\\u00e9", null, true]}') == {"a": [1, 2.5, "é", None, True]}
    assert strict_json('{"é": 1}'.encode("utf-8")) == {"é": 1}
    assert strict_json(b"  1e308 ") == 1e308


@pytest.mark.parametrize("raw", [b"NaN", b"[Infinity]", b'{"a": -Infinity}'])
def test_the_constants_python_accepts_are_not_json(raw):
    with pytest.raises(ValueError, match=r"is not a JSON number"):
        strict_json(raw)


@pytest.mark.parametrize("raw", [b'{"a": "\xff"}', b'"\xc3"', b'"\xed\xa0\x80"'])  # not UTF-8 (last: a surrogate)
def test_bytes_that_are_not_utf8_are_refused(raw):
    with pytest.raises(ValueError):
        strict_json(raw)


@pytest.mark.parametrize("raw", [b"", b"{", b"{'a': 1}", b"[1,]", b"\xef\xbb\xbf{}"])  # the last: a BOM
def test_text_that_is_not_json_is_refused(raw):
    with pytest.raises(ValueError):
        strict_json(raw)


def test_nesting_too_deep_is_a_recursion_error():
    with pytest.raises(RecursionError):
        strict_json(b"[" * 100_000 + b"]" * 100_000)


# -- name_max, check_name_length, partial_sibling ----------------------------------------------------------------------

def test_the_longest_name_is_the_file_systems_and_255_where_none_says(tmp_path):
    assert name_max(str(tmp_path)) == os.pathconf(str(tmp_path), "PC_NAME_MAX")
    assert name_max(str(tmp_path / "missing" / "dir")) == 255  # pathconf fails: the usual limit


def test_a_name_the_file_system_holds_is_accepted(tmp_path):
    limit = name_max(str(tmp_path))
    name = tmp_path / ("a" * limit)
    check_name_length(name, "the trace")
    name.write_bytes(b"")  # and the file system does hold it


def test_an_over_long_name_is_refused_in_bytes(tmp_path):
    limit = name_max(str(tmp_path))
    over = "é" * (limit // 2 + 1)  # fewer characters than the limit, more bytes
    assert len(over) <= limit < len(over.encode("utf-8"))
    with pytest.raises(PrefillDiffError) as e:
        check_name_length(tmp_path / over, "the trace")
    n = len(over.encode("utf-8"))
    assert str(e.value) == (f"cannot write the trace: its file name is {n} bytes, more than the {limit} the file "
                            f"system allows ({'é' * 40}...)")
    with pytest.raises(OSError):
        (tmp_path / over).write_bytes(b"")  # the file system agrees


def test_an_over_long_name_is_shown_visibly(tmp_path):
    name = "\x1b[2J" + "x" * 300
    with pytest.raises(PrefillDiffError) as e:
        check_name_length(tmp_path / name, "the report")
    assert "\x1b" not in str(e.value) and "(\\x1b[2Jxxx" in str(e.value)


_TAG = rf"partial-{os.getpid()}-[0-9a-f]{{8}}"


def test_a_partial_sibling_is_hidden_beside_its_file(tmp_path):
    got = partial_sibling(tmp_path / "trace.h5")
    assert os.path.dirname(got) == str(tmp_path)
    assert re.fullmatch(rf"\.trace\.h5\.{_TAG}", os.path.basename(got)), got
    assert re.fullmatch(rf"\.out\.json\.{_TAG}", partial_sibling("out.json")), "a bare name stays bare"


def test_a_partial_sibling_of_a_long_name_drops_the_name(tmp_path):
    limit = name_max(str(tmp_path))
    long = tmp_path / ("t" * (limit - 3))
    got = partial_sibling(long)
    assert re.fullmatch(rf"\.{_TAG}", os.path.basename(got)), got
    with open(got, "wb"):  # the file system holds it
        pass


# -- check_int64 -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -1, 7, INT64_MIN, INT64_MAX, 2**63 - 1, -(2**63)])
def test_an_int64_is_returned(value):
    assert check_int64(value, "seed") == value


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30])
def test_an_integer_outside_int64_is_refused(value):
    with pytest.raises(ConfigError) as e:
        check_int64(value, "[run] seed")
    assert str(e.value) == f"[run] seed is {value}, outside the 64-bit integer range"


def test_an_integer_of_many_digits_is_shortened():
    value = 10**100
    with pytest.raises(ConfigError) as e:
        check_int64(value, "--seed")
    assert str(e.value) == "--seed is 10000000000000000000… (101 digits), outside the 64-bit integer range"


# -- check_prompt_text -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["Hello", "", "héllo 模型 🙂", "\ufffd", "tab\tand\nnewline"])
def test_utf8_text_is_a_prompt(prompt):
    assert check_prompt_text(prompt, 0) is None


@pytest.mark.parametrize("raw, byte, offset", [
    (b"\xff", 0xFF, 0), (b"ab\x80cd", 0x80, 2), ("é".encode() + b"\xc3", 0xC3, 2),
    ("模".encode() + b"x\xfe\xff", 0xFE, 4),  # the first bad byte, counted in bytes after 3-byte and 1-byte characters
])
def test_bytes_that_are_not_utf8_are_refused_at_their_offset(raw, byte, offset):
    prompt = raw.decode("utf-8", "surrogateescape")  # how the command line hands them over
    with pytest.raises(ConfigError) as e:
        check_prompt_text(prompt, 2)
    assert str(e.value) == f"prompt 2 is not valid UTF-8 text (byte 0x{byte:02x} at byte offset {offset})"


def test_a_lone_surrogate_that_is_no_byte_is_named_as_a_code_point():
    with pytest.raises(ConfigError) as e:
        check_prompt_text("ab\ud83d", 0)
    assert str(e.value) == "prompt 0 is not valid UTF-8 text (code point U+D83D at byte offset 2)"
