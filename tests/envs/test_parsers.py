import pytest

from marin_rl.envs import ParseResult, compose, first_of, get_parser, identity, last_boxed, last_number, xml_tag


def test_xml_tag_takes_the_last_tag_and_rewards_format():
    parse = xml_tag("answer", reward=0.5, penalty=-1.0)
    assert parse("<answer>1</answer> then <answer> 2 </answer>") == ParseResult("2", 0.5)
    assert parse("no tags") == ParseResult(None, -1.0)
    assert parse("<answer>multi\nline</answer>").value == "multi\nline"


def test_last_boxed_balances_braces():
    assert last_boxed()("so \\boxed{1} or \\boxed{\\frac{1}{2}}.").value == "\\frac{1}{2}"
    assert last_boxed()("\\fbox{x}").value == "x"
    assert last_boxed()("\\boxed{unclosed").value is None
    assert last_boxed()("nothing").ok is False


def test_last_number_strips_thousands_separators():
    assert last_number()("from 3 to 1,000 apples").value == "1000"
    assert last_number()("x = -2.5e3").value == "-2.5e3"
    assert last_number()("none").value is None


def test_compose_short_circuits_and_accumulates_rewards():
    parse = compose(xml_tag("answer", reward=0.1), last_number(reward=0.2, penalty=-0.3))
    assert parse("<answer>x = 42</answer>") == ParseResult("42", pytest.approx(0.3))
    assert parse("<answer>no number</answer>") == ParseResult(None, pytest.approx(-0.2))
    calls = []

    def spy(text):
        calls.append(text)
        return ParseResult(text)

    assert compose(xml_tag("answer"), spy)("untagged").value is None
    assert calls == []  # stopped at the first failure


def test_first_of_keeps_the_first_success():
    parse = first_of(xml_tag("answer", reward=1.0), last_number())
    assert parse("<answer>7</answer> 9") == ParseResult("7", 1.0)
    assert parse("just 9") == ParseResult("9", 0.0)
    assert parse("nothing").value is None


def test_parsers_by_config_name():
    assert get_parser("boxed")("\\boxed{3}") == ParseResult("3", 1.0)
    assert get_parser("none") is identity
    with pytest.raises(ValueError, match="known parsers"):
        get_parser("nope")
