"""draw() renders the graph for notebooks."""

import flowopt
from flowopt.modules import ChainOfThought, Predict


def test_draw_png_and_svg(tmp_path):
    wf = (flowopt.Workflow("question -> answer", name="qa")
          .add("draft", Predict("question -> draft"))
          .add("final", ChainOfThought("question, draft -> answer")))
    png = wf.draw(tmp_path / "graph.png")
    assert png.startswith(b"\x89PNG") and (tmp_path / "graph.png").read_bytes() == png
    svg = wf.draw(fmt="svg").decode()
    for text in ("draft", "final", "[ChainOfThought]", "$input", "$output"):
        assert text in svg
