"""notebooks/demo.ipynb runs end to end (nbclient), so the demo never rots."""
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).parents[1]


@pytest.mark.slow  # 25-40 s: a kernel process, MiniLM, the tiny preset and a short bench
def test_demo_notebook_runs():
    nb = nbformat.read(ROOT / "notebooks" / "demo.ipynb", as_version=4)
    for cell in nb.cells:  # run from a clean slate, not the saved outputs
        if cell.cell_type == "code":
            cell.outputs = []
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "104 documents" in text and "round 2:" in text
    assert all(name in text for name in ("ibs", "fcfs", "homogeneous"))
    assert any("image/png" in o.get("data", {}) for o in outputs), "the scheduler plot is missing"
    if "all-MiniLM-L6-v2 (real weights)" in text:  # real retrieval: the obvious documents win
        hits = [line for line in text.splitlines() if re.match(r"\d\.\d{3}  ", line)]
        assert "Jupiter" in hits[0], hits
        assert "round 1: Nile" in text and "round 1: Penicillin" in text
