"""The pipeline's stages and the mailboxes between them, declared as data.

A pipeline is inputs → router → formulas → the formulas that read the others' output (the node
formula's shares, the energy formula) → outputs, and, for the input kinds an output takes as
they are (``--output mongodb --model GPUReport``), inputs → outputs too. :class:`StageGraph`
holds that shape as its edges: each is one stage's bounded mailbox and the stages that put
into it. The pipeline reads it to wire itself once, at its start (how many producers each
mailbox waits for before it closes, and how many copies of a checkpoint's barrier each formula
waits for), and to close each mailbox its producers feed once they are done, so the drain goes
front to back whatever the shape. Nothing is rewired later; the debug log shows the graph at
start.
"""

from __future__ import annotations

from dataclasses import dataclass

INPUTS = "inputs"
"""The inputs as one producer: the drain closes what they feed once every input has ended and
the last checkpoint's barrier has gone in."""
ROUTER = "router"


@dataclass(frozen=True)
class Edge:
    """A stage's mailbox and the stages that put into it (it closes once each of them did)."""

    consumer: str
    producers: tuple[str, ...]


@dataclass(frozen=True)
class StageGraph:
    """Which stage feeds which: the pipeline's topology, decided once from its settings."""

    edges: tuple[Edge, ...]

    @classmethod
    def of(
        cls,
        formulas: list[str],
        readers: list[str],
        outputs: list[str],
        *,
        passed_through: bool,
    ) -> StageGraph:
        """The graph of a pipeline with these formulas (``readers`` among them read the
        others' output) and outputs; ``passed_through``: an output takes input reports too.

        The outputs wait for every formula, and for the inputs when they feed the outputs or
        when there is no formula at all (the inputs' end then closes them).
        """
        first = tuple(name for name in formulas if name not in readers)
        to_outputs = tuple(formulas) + ((INPUTS,) if passed_through or not formulas else ())
        return cls(
            (
                Edge(ROUTER, (INPUTS,)),
                *(Edge(name, (ROUTER,)) for name in first),
                *(Edge(name, (ROUTER, *first)) for name in readers),
                *(Edge(name, to_outputs) for name in outputs),
            )
        )

    def producers(self, consumer: str) -> tuple[str, ...]:
        return next(edge.producers for edge in self.edges if edge.consumer == consumer)

    def consumers(self, producer: str) -> list[str]:
        """The stages whose mailboxes ``producer`` puts into, in the order they are declared."""
        return [edge.consumer for edge in self.edges if producer in edge.producers]

    def readers_of(self, producer: str) -> list[str]:
        """The formulas that read ``producer``'s output (the consumers that are not outputs)."""
        return [
            edge.consumer
            for edge in self.edges
            if producer in edge.producers and ROUTER in edge.producers
        ]

    def describe(self) -> list[str]:
        """One line per edge, ``consumer ← producers``, as the log shows the graph."""
        return [f"{edge.consumer} ← {', '.join(edge.producers)}" for edge in self.edges]
