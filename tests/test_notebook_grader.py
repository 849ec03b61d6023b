"""The exercises' ``grader`` (course_lib.exercises.notebook_grader): its reports show every
character of their messages, in a notebook as in a terminal.

    python -m pytest tests/test_notebook_grader.py -q
"""

from __future__ import annotations

import textwrap
from html.parser import HTMLParser

import nbformat
import pytest
from nbclient import NotebookClient

from course_lib.exercises.notebook_grader import CheckReport, NotebookGrader

# An exception-based otter test file (the format the exercises' tests are in): the answer must be a
# list; the message names the type it got, "<class 'int'>", which looks like a tag.
TEST_FILE = textwrap.dedent("""\
    from otter.test_files import test_case

    OK_FORMAT = False

    name = "q1"
    points = [1]

    @test_case(points=None, hidden=False)
    def test_is_a_list(answer):
        assert isinstance(answer, list), f"answer must be a list, got {type(answer)} from <dynamic-code>"
""")


class _Text(HTMLParser):
    """The text a browser shows for an HTML fragment: tags dropped, entities decoded."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.text = ""
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text += data


def shown(fragment: str) -> _Text:
    parser = _Text()
    parser.feed(fragment)
    parser.close()
    return parser


@pytest.fixture
def exercise(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "q1.py").write_text(TEST_FILE, encoding="utf-8")
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "ex.ipynb")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_failure_shows_its_whole_message_as_html(exercise):
    grader = NotebookGrader("ex.ipynb")
    report = grader.check("q1", {"answer": 3})
    assert isinstance(report, CheckReport) and report.passed_all is False  # otter's result reads through
    text = repr(report)
    assert "got <class 'int'> from <dynamic-code>" in text, text
    html = report._repr_html_()
    page = shown(html)
    # what the notebook shows is the text report, character for character: no "tag" swallowed
    assert page.text == text, (page.text, text)
    assert page.tags == ["pre", "strong"], html
    assert "&lt;class &#x27;int&#x27;&gt;" in html and "#c62828" in html  # escaped; the title in red
    assert "<class" not in html  # what otter's own report leaves in: the browser drops it


def test_a_pass_is_green_and_check_reads_the_callers_globals(exercise):
    grader = NotebookGrader("ex.ipynb")
    scope = {"grader": grader, "answer": [1, 2]}
    exec("report = grader.check('q1')", scope)  # no environment given: the calling code's globals
    report = scope["report"]
    assert report.passed_all is True
    assert shown(report._repr_html_()).text == repr(report) == "q1 results: All test cases passed!"
    assert "#1a7f37" in report._repr_html_()
    exec("results = grader.check_all()", scope)  # otter's, calling check: its totals still add up
    assert (scope["results"].total, scope["results"].possible) == (1, 1)


@pytest.mark.timeout(180)
def test_in_a_kernel_the_html_report_says_what_the_text_report_says(exercise):
    """What a student sees: the setup cell the exercises use, a wrong answer, grader.check."""
    from course_lib.exercises import exercise_setup_cell

    setup = exercise_setup_cell("ex")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup),
                                         nbformat.v4.new_code_cell("answer = 3"),
                                         nbformat.v4.new_code_cell('grader.check("q1")')])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(exercise)}}).execute()
    (out,) = nb.cells[2].outputs
    assert out.output_type == "execute_result", out
    text, html = out.data["text/plain"], out.data["text/html"]
    assert "got <class 'int'> from <dynamic-code>" in text, text
    assert shown(html).text == text, (html, text)
