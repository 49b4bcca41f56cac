"""visible_text: the one rule for the text a caller sees while a request runs and when it ends."""
from specmoe.engine.core import visible_text


def test_finished_text_is_cut_at_the_first_stop():
    assert visible_text("abc<END>def<X>", ["<X>", "<END>"], finished=True) == "abc"
    assert visible_text("abc", [], finished=True) == "abc"


def test_running_text_withholds_what_may_become_a_stop_or_a_character():
    assert visible_text("hello <E", ["<END>"], finished=False) == "hello "
    assert visible_text("hello <", ["<END>", "<X>"], finished=False) == "hello "
    assert visible_text("hello", ["<END>"], finished=False) == "hello"
    assert visible_text("caf\ufffd", [], finished=False) == "caf"  # an incomplete UTF-8 character
    # every prefix's visible text is a prefix of the final text
    final = "one two <END> three"
    shown = [visible_text(final[:i], ["<END>"], finished=False) for i in range(len(final) + 1)]
    assert all(visible_text(final, ["<END>"], True).startswith(s) for s in shown)
