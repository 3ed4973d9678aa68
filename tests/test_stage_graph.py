"""The pipeline's stages and mailboxes declared as data (``actors/graph.py``): what a command
line's pipeline is wired as, and that each mailbox closes once every producer its edge names
is done (the drain goes front to back)."""

from __future__ import annotations

from pathlib import Path

from wattflow.actors.graph import INPUTS, ROUTER, Edge, StageGraph
from wattflow.service.cli import load_run_config
from wattflow.service.pipeline import assemble

from .conftest import run_async


def test_a_node_with_shares_and_a_recorded_sampler_is_wired_as_its_graph_says(
    tmp_path: Path,
) -> None:
    """hwpc-sensor's reports, GPU samples recorded as they are, a meter: SmartWatts, RAPL and
    the GPU formula feed the node formula (shares) and the outputs; the GPU samples go to the
    output that takes them straight from the inputs."""
    hwpc, gpu, meter = (tmp_path / name for name in ("hwpc.jsonl", "gpu.jsonl", "meter.csv"))
    hwpc.write_text("")
    gpu.write_text("")
    meter.write_text("timestamp,d0c0\n")
    config = load_run_config([
        "run", "--input", "jsonl", "--name", "hwpc", "--files", str(hwpc),
        "--input", "jsonl", "--model", "GPUReport", "--name", "gpus", "--files", str(gpu),
        "--input", "meter", "--name", "meter", "--files", str(meter), "--sensor", "n",
        "--output", "jsonl", "--name", "power", "--file", str(tmp_path / "power.jsonl"),
        "--output", "jsonl", "--model", "GPUReport", "--name", "samples",
        "--file", str(tmp_path / "samples.jsonl"),
        "--node-shares",
    ][1:])  # fmt: skip
    pipeline = assemble(config)
    formulas = ("formula:gpu", "formula:rapl", "formula:smartwatts")  # as registered
    every_formula = ("formula:gpu", "formula:node", "formula:rapl", "formula:smartwatts")
    assert pipeline.graph.edges == (
        Edge(ROUTER, (INPUTS,)),
        *(Edge(name, (ROUTER,)) for name in formulas),
        Edge("formula:node", (ROUTER, *formulas)),
        Edge("pusher:power", (*every_formula, INPUTS)),
        Edge("pusher:samples", (*every_formula, INPUTS)),
    )
    assert pipeline.formula_named("formula:node").producers == 4, "a barrier copy from each"
    assert pipeline.graph.describe()[4] == "formula:node ← router, " + ", ".join(formulas)
    result = run_async(pipeline.run())
    assert result.ok, result.failures
    assert result.ledger.balanced(), "every mailbox closed: the drain ended"


def test_outputs_with_no_formula_close_when_the_inputs_end() -> None:
    graph = StageGraph.of([], [], ["pusher:out"], passed_through=False)
    assert graph.edges == (Edge(ROUTER, (INPUTS,)), Edge("pusher:out", (INPUTS,)))
    assert graph.consumers(INPUTS) == [ROUTER, "pusher:out"]
    assert graph.readers_of(INPUTS) == []
