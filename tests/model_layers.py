"""A model graph's decoder-layer groups, whatever the layers' grouping."""

from __future__ import annotations

from lum.builder.partition import Group, group_chunks, partition


def layer_groups(graph) -> list[Group]:
    """Every group of ``graph`` but the one of its first chunk (the embedding and the step's tables) and the one of
    its last (the final norm and the LM head). The layers are one group, or two where each decode layer ends with
    the next one's input norm (``norms_ahead``) and the last layer, which ends with the final norm, stands alone."""
    chunks = partition(graph)
    ends = {0, len(chunks) - 1}
    return [g for g in group_chunks(graph, chunks) if not ends & set(g.chunks)]
