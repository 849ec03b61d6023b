"""The committed diagram renderings, their hash check, and diagrams.show with its fallbacks.

    python -m pytest tests/test_images.py

No browser is needed: rendering itself (`make images`) is replaced by a stand-in mmdc here.
"""

from __future__ import annotations

import base64
import http.server
import itertools
import json
import re
import shutil
import sys
import threading
import time
from urllib.parse import unquote

import pytest

from course_lib.notebook import diagrams, diagrams_build
from course_lib.utils import free_port, repo_root

ROOT = repo_root()
REQUIRED = {"dp_forward", "dp_backward", "dp_step", "allreduce_ring", "broadcast", "zero_stages",
            "model_parallel_split", "pipeline_schedule", "strategy_guide", "pram_models"}
PNG_1x1 = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def test_issue_diagrams_exist():
    assert REQUIRED <= set(diagrams.names())


def test_committed_renderings_are_up_to_date_and_valid():
    assert diagrams_build.check_diagrams() == [], "run `make images` and commit images/diagrams/rendered/"
    rendered = ROOT / diagrams.RENDERED
    manifest = json.loads((rendered / "manifest.json").read_text())
    assert set(manifest["diagrams"]) == set(diagrams.names())
    for name in diagrams.names():
        assert diagrams_build.is_svg((rendered / f"{name}.svg").read_text()), name
        assert diagrams_build.is_png((rendered / f"{name}.png").read_bytes()), name


def test_validators_reject_broken_files():
    assert diagrams_build.is_png(PNG_1x1)
    assert not diagrams_build.is_png(PNG_1x1[:20])
    assert not diagrams_build.is_png(b"GIF89a" + PNG_1x1[6:])
    assert diagrams_build.is_svg('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1 1"><g/></svg>')
    assert not diagrams_build.is_svg('<svg xmlns="http://www.w3.org/2000/svg"><g/></svg>')  # no viewBox
    assert not diagrams_build.is_svg('<svg viewBox="0 0 1 1"><g></svg>')  # not well-formed
    assert not diagrams_build.is_svg('<html viewBox="0 0 1 1"><g/></html>')


@pytest.fixture
def tmp_repo(tmp_path):
    """A copy of images/diagrams with two diagrams, their renderings and a trimmed manifest."""
    src, dst = ROOT / diagrams.DIAGRAM_SOURCES, tmp_path / diagrams.DIAGRAM_SOURCES
    (dst / "rendered").mkdir(parents=True)
    shutil.copy(src / diagrams.CONFIG, dst / diagrams.CONFIG)
    manifest = json.loads((ROOT / diagrams.RENDERED / "manifest.json").read_text())
    keep = ["broadcast", "dp_step"]
    for name in keep:
        shutil.copy(src / f"{name}.mmd", dst / f"{name}.mmd")
        for ext in ("svg", "png"):
            shutil.copy(src / "rendered" / f"{name}.{ext}", dst / "rendered" / f"{name}.{ext}")
    manifest["diagrams"] = {k: manifest["diagrams"][k] for k in keep}
    (dst / "rendered" / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def test_check_notices_every_kind_of_staleness(tmp_repo):
    d = tmp_repo / diagrams.DIAGRAM_SOURCES
    assert diagrams_build.check_diagrams(tmp_repo) == []
    # CRLF line endings (a Windows checkout) are not a change
    (d / "broadcast.mmd").write_bytes((d / "broadcast.mmd").read_bytes().replace(b"\n", b"\r\n"))
    assert diagrams_build.check_diagrams(tmp_repo) == []
    (d / "broadcast.mmd").write_text((d / "broadcast.mmd").read_text() + "    r3 --> r1\n")
    (d / "rendered" / "dp_step.png").write_bytes(b"not a png")
    (d / "new_one.mmd").write_text("flowchart LR\n a --> b\n")
    problems = "\n".join(diagrams_build.check_diagrams(tmp_repo))
    assert "broadcast: broadcast.mmd changed since it was rendered" in problems
    assert "dp_step.png is not a valid PNG" in problems
    assert "new_one: never rendered" in problems
    (d / "dp_step.mmd").unlink()
    (d / diagrams.CONFIG).write_text('{"theme": "dark"}')
    problems = "\n".join(diagrams_build.check_diagrams(tmp_repo))
    assert "dp_step: rendered, but dp_step.mmd no longer exists" in problems
    assert "mermaid-config.json changed" in problems


def test_check_notices_a_hand_edited_rendering(tmp_repo):
    svg = tmp_repo / diagrams.RENDERED / "dp_step.svg"
    svg.write_text(svg.read_text().replace("</svg>", "<!-- touched up by hand --></svg>"))
    assert [p for p in diagrams_build.check_diagrams(tmp_repo) if "differs from the recorded rendering" in p]


FAKE_MMDC = '''#!{python}
"""Stand-in for mermaid-cli: writes a small SVG or PNG naming the source it was given."""
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("0.0-test"); sys.exit(0)
src, out = args[args.index("-i") + 1], args[args.index("-o") + 1]
if "syntax error" in open(src).read():
    print("Parse error on line 2", file=sys.stderr); sys.exit(1)
if out.endswith(".svg"):
    open(out, "w").write('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 10 10"><title>%s</title></svg>' % src)
else:
    open(out, "wb").write({png!r})
'''


def test_build_renders_only_stale_diagrams_and_records_hashes(tmp_repo, tmp_path, monkeypatch):
    mmdc = tmp_path / "mmdc"
    mmdc.write_text(FAKE_MMDC.format(python=sys.executable, png=PNG_1x1))
    mmdc.chmod(0o755)
    monkeypatch.setenv("COURSE_MMDC", str(mmdc))
    monkeypatch.setenv("COURSE_CHROMIUM", sys.executable)  # any existing file: the stand-in ignores it
    d = tmp_repo / diagrams.DIAGRAM_SOURCES
    # a new renderer version re-renders everything
    assert diagrams_build.build_diagrams(root=tmp_repo) == ["broadcast", "dp_step"]
    assert diagrams_build.check_diagrams(tmp_repo) == []
    assert diagrams_build.build_diagrams(root=tmp_repo) == []  # nothing stale
    (d / "broadcast.mmd").write_text("flowchart LR\n a --> b\n")
    (d / "dp_step.mmd").unlink()
    assert diagrams_build.build_diagrams(root=tmp_repo) == ["broadcast"]
    manifest = diagrams_build.load_manifest(tmp_repo)
    assert manifest["renderer"] == "@mermaid-js/mermaid-cli 0.0-test"
    assert set(manifest["diagrams"]) == {"broadcast"}
    assert not (d / "rendered" / "dp_step.svg").exists()
    assert "broadcast.mmd" in (d / "rendered" / "broadcast.svg").read_text()
    assert diagrams_build.check_diagrams(tmp_repo) == []
    # a failing render raises with mmdc's message and leaves the last good rendering in place
    (d / "broadcast.mmd").write_text("flowchart LR\n syntax error\n")
    with pytest.raises(RuntimeError, match="Parse error on line 2"):
        diagrams_build.build_diagrams(root=tmp_repo)
    assert "broadcast.mmd" in (d / "rendered" / "broadcast.svg").read_text()
    with pytest.raises(ValueError, match="no diagram named 'nope'"):
        diagrams_build.build_diagrams(["nope"], root=tmp_repo)


def test_build_says_how_to_get_mermaid_cli(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_MMDC", "/nonexistent/mmdc")
    assert diagrams_build.cli(["build"]) == 1
    assert "make images" in capsys.readouterr().err
    assert diagrams_build.cli(["check"]) == 0


# ------------------------------------------------------------------ the diagrams say what the course teaches

def _gantt_tasks(text: str) -> dict[tuple[str, int], list[tuple[str, int, int]]]:
    """(schedule, gpu) -> [(task, start, end)] from the pipeline gantt chart."""
    tasks, section = {}, None
    for line in text.splitlines():
        if m := re.match(r"\s*section (\w+) · GPU (\d)", line):
            section = (m.group(1), int(m.group(2)))
            tasks[section] = []
        elif section and (m := re.match(r"\s*([FB]\d+) :(?:crit, )?\w+, (\d+), (\d+)", line)):
            tasks[section].append((m.group(1), int(m.group(2)), int(m.group(3))))
    return tasks


def test_pipeline_schedule_obeys_dependencies_and_bubble_formula():
    """AFAB (GPipe, Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021): with p
    stages and m micro-batches both take (m + p - 1)(t_F + t_B); 1F1B keeps at most p - s
    micro-batches in flight on stage s, AFAB all m."""
    tasks = _gantt_tasks(diagrams.mermaid_source("pipeline_schedule"))
    p, m, t_f, t_b = 4, 6, 1, 2
    for kind in ("AFAB", "1F1B"):
        end = {}
        for s in range(p):
            ops = sorted(tasks[(kind, s)], key=lambda t: t[1])
            assert len(ops) == 2 * m
            for (_, _, e1), (_, s2, _) in itertools.pairwise(ops):
                assert s2 >= e1, f"{kind} GPU {s} runs two things at once"
            in_flight = peak = 0
            for name, a, b in ops:
                assert b - a == (t_f if name[0] == "F" else t_b)
                end[(name, s)] = (a, b)
                in_flight += 1 if name[0] == "F" else -1
                peak = max(peak, in_flight)
            assert peak == (m if kind == "AFAB" else p - s)
        for (name, s), (a, _) in end.items():
            if name[0] == "F" and s > 0:
                assert a >= end[(name, s - 1)][1]
            if name[0] == "B":
                after = end[(name, s + 1)][1] if s < p - 1 else end[("F" + name[1:], s)][1]
                assert a >= after
        assert max(b for _, b in end.values()) == (m + p - 1) * (t_f + t_b)


def _bytes(expr: str, psi: float, n: int) -> float:
    """Value of a label such as "4Ψ + 12Ψ/N" for Ψ = psi parameters and N = n ranks."""
    total = 0.0
    for term in expr.split("+"):
        m = re.fullmatch(r"\s*(\d+)Ψ(/N)?\s*", term)
        assert m, f"unexpected term {term!r} in {expr!r}"
        total += int(m.group(1)) * psi / (n if m.group(2) else 1)
    return total


def test_zero_stages_diagram_matches_the_memory_model():
    """Every byte count in zero_stages.mmd equals course_lib.analysis.memory (ZeRO paper, Section 5)."""
    from course_lib.analysis.memory import model_state_bytes

    text = diagrams.mermaid_source("zero_stages")
    psi, n = 1000.0, 8
    titles = dict(re.findall(r'subgraph s(\d) \[".*?: ([^"]+)"\]', text))
    assert set(titles) == {"0", "1", "2", "3"}
    for stage, formula in titles.items():
        states = model_state_bytes(psi, n, int(stage))
        assert _bytes(formula, psi, n) == pytest.approx(states.total), formula
        for field, label in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer states")):
            expr = re.search(rf'{label[0]}{stage}\["{label}: [^(]*\(([^)]+)\)"\]', text).group(1)
            assert _bytes(expr, psi, n) == pytest.approx(getattr(states, field)), (stage, label)


# ------------------------------------------------------------------ diagrams.show and its fallbacks

def test_show_displays_the_committed_rendering(capsys):
    assert diagrams.show("dp_step") is None  # a notebook cell ending in show() displays it once
    assert "[diagram dp_step: committed]" in capsys.readouterr().out  # display() outside IPython
    fig = diagrams.diagram("dp_step")
    assert fig.how == "committed" and fig.note == ""
    assert fig.svg == (ROOT / diagrams.RENDERED / "dp_step.svg").read_text()
    html = fig._repr_html_()
    assert 'alt="diagram: dp_step"' in html and "data:image/svg+xml;base64," in html
    assert base64.b64decode(fig._repr_mimebundle_()["image/png"]) == fig.png
    with pytest.raises(ValueError, match="no diagram named 'dp_stepp'.*dp_step"):
        diagrams.diagram("dp_stepp")


class _FakeInk(http.server.BaseHTTPRequestHandler):
    """mermaid.ink's two endpoints: /svg/<base64 source> and /img/<base64 source>."""

    mode = "ok"

    def do_GET(self):
        if self.mode == "slow":
            time.sleep(2)
        if self.mode == "reject":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b"invalid encoded code")
            return
        kind, code = self.path.split("?")[0].strip("/").split("/", 1)
        source = base64.urlsafe_b64decode(unquote(code)).decode()
        body = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 40 10"><text>{source}</text></svg>'.encode()
                if kind == "svg" else PNG_1x1)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_ink(monkeypatch):
    handler = type("Handler", (_FakeInk,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("MERMAID_INK_SERVER", f"http://127.0.0.1:{server.server_address[1]}")
    yield handler
    server.shutdown()
    server.server_close()


def test_live_rendering_through_mermaid_py(fake_ink):
    edited = diagrams.mermaid_source("broadcast").replace("rank 3", "rank 7")
    fig = diagrams.diagram("broadcast", source=edited)
    assert fig.how == "live" and "rank 7" in fig.svg and fig.png == PNG_1x1
    assert diagrams.diagram("broadcast", live=True).how == "live"
    assert diagrams.diagram("broadcast").how == "committed"  # live only when asked or edited


@pytest.mark.timeout(20)
def test_offline_falls_back_with_a_note(monkeypatch):
    monkeypatch.setenv("MERMAID_INK_SERVER", f"http://127.0.0.1:{free_port()}")  # nobody listens
    fig = diagrams.diagram("broadcast", live=True)
    assert fig.how == "committed" and fig.svg is not None
    assert "Live rendering failed: cannot reach" in fig.note and "committed rendering" in fig.note
    assert "Live rendering failed" in fig._repr_html_()
    # an unedited "edit" is the committed diagram
    assert diagrams.diagram("broadcast", source=diagrams.mermaid_source("broadcast") + "\n").how == "committed"
    edited = diagrams.mermaid_source("broadcast") + '    r3 --> r4["rank 4 <new>"]\n'
    fig = diagrams.diagram("broadcast", source=edited)
    assert fig.how == "source" and fig.source == edited
    html = fig._repr_html_()
    assert "rank 4 &lt;new&gt;" in html and "https://mermaid.live" in html and "make images" in html


@pytest.mark.timeout(20)
def test_service_errors_and_timeouts_fall_back(fake_ink):
    edited = "flowchart LR\n  a -->"
    fake_ink.mode = "reject"
    fig = diagrams.diagram("broadcast", source=edited)
    assert fig.how == "source" and "Bad Request" in fig.note
    fake_ink.mode = "slow"
    t0 = time.monotonic()
    fig = diagrams.diagram("broadcast", live=True, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    assert fig.how == "committed" and "no answer from" in fig.note


def test_without_a_clone_the_packaged_copy_is_shown(monkeypatch, tmp_path):
    """An installed wheel (Colab) has no images/: the package's _diagrams, a link to images/diagrams
    here and a copy in the wheel (tests/test_colab_wheel.py checks the wheel's bytes)."""
    assert diagrams.PACKAGED.resolve() == (ROOT / diagrams.DIAGRAM_SOURCES).resolve()
    monkeypatch.setattr(diagrams, "repo_root", lambda: None)
    fig = diagrams.diagram("dp_step")
    assert fig.how == "committed" and fig.svg == (ROOT / diagrams.RENDERED / "dp_step.svg").read_text()
    assert diagrams.mermaid_source("broadcast") == (ROOT / diagrams.DIAGRAM_SOURCES / "broadcast.mmd").read_text()
    assert diagrams.names() == sorted(p.stem for p in (ROOT / diagrams.DIAGRAM_SOURCES).glob("*.mmd"))
    monkeypatch.setenv("MERMAID_INK_SERVER", f"http://127.0.0.1:{free_port()}")
    fig = diagrams.diagram("dp_step", source="flowchart LR\n a --> b", live=True)
    assert fig.how == "source" and fig.source == "flowchart LR\n a --> b"
    monkeypatch.setattr(diagrams, "PACKAGED", tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="reinstall course-lib"):
        diagrams.mermaid_source("broadcast")
