"""The argument types the scripts share (scripts/args.py), in this process: a bad value is refused
naming itself and what is allowed, a good one parses. tests/test_scripts.py runs each script as a
real process once per kind of refusal; these are the values between.

    .venv/bin/python -m pytest tests/test_script_args.py -q
"""

import argparse

import pytest

from scripts.args import ArgumentParser, directory, names, non_negative_ints, positive_int, positive_ints

IMPLS = names(["triton", "sdpa"])


@pytest.mark.parametrize("parse, text, want", [
    (positive_int, "3", 3), (positive_ints, "1024,8192", [1024, 8192]), (non_negative_ints, "0,65536", [0, 65536]),
    (IMPLS, "sdpa,triton", ["sdpa", "triton"]),
])
def test_a_good_value_parses(parse, text, want):
    assert parse(text) == want


@pytest.mark.parametrize("parse, text, named, allowed", [
    (positive_int, "0", "'0'", "a positive integer"), (positive_int, "abc", "'abc'", "a positive integer"),
    (positive_ints, "1024,abc", "'abc'", "a positive integer"), (positive_ints, "0", "'0'", "a positive integer"),
    (positive_ints, "1024,1024", "'1024' is listed twice", "each value once"),
    (non_negative_ints, "0,-1", "'-1'", "an integer >= 0"),
    (IMPLS, "triton,nosuch", "'nosuch'", "one of triton, sdpa"),
])
def test_a_bad_value_names_itself_and_what_is_allowed(parse, text, named, allowed):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(text)
    assert named in str(e.value) and allowed in str(e.value) and "\n" not in str(e.value)


def test_a_directory_argument_refuses_a_file_in_the_way_and_creates_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    for text in (tmp_path / "file", tmp_path / "file" / "under"):
        with pytest.raises(argparse.ArgumentTypeError, match="is a file"):
            directory(str(text))
    assert directory(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # made when the work starts, not here


def test_the_parser_exits_2_with_one_line_naming_the_argument(capsys):
    parser = ArgumentParser(prog="demo.py")
    parser.add_argument("--seq-lens", type=positive_ints)
    for argv, said in ((["--seq-lens", "0"], "argument --seq-lens: '0'"), (["--bogus"], "unrecognized arguments")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
